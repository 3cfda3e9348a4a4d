"""Direct per-example formulas for Keras layers: which layers have one, and how each is recorded.

A `Rule` replaces a layer's `call` while a forward pass is recorded (`recording.py`). The
replacement computes the same outputs as Keras' own `call`, and also registers:
* the tensors the formulas need (the layer input x, or the normalised input x_hat);
* the watched output z (the linear part, before bias and activation), whose gradient dz comes
  from the caller's backward pass;
* one `terms.Term` per variable, turning dz into per-example gradients, Gram norms and dots, and
  a `terms.Joint` for a kernel and its bias together.

Covered here (exact Keras classes, channels_last, no LoRA, no quantization, no remat):
* `Dense`: z = x W (then + b). W: outer-product term over the positions of x (rank >= 2);
  b: sum of dz over positions.
* `EinsumDense` with a leading explicit batch letter not in the kernel (MultiHeadAttention's
  projections): outer-product term when the equation is "batch, positions, contracted ->
  batch, positions, kernel outputs" (e.g. "abc,cde->abde"), else the kernel-gradient einsum
  with the batch letter kept.
* `Embedding`: z = rows of E at the ids. Per-example gradient: dz rows scattered into
  [vocabulary, dim], duplicates within an example summed; squared norm by the token-equality Gram
  sum_{t,s} [id_t = id_s] <dz_t, dz_s>; dot with g as sum_t <g[id_t], dz_t>.
* `LayerNormalization` (not rms_scaling) and `GroupNormalization`: out = x_hat * gamma + beta;
  gamma_i = sum over non-parameter axes of x_hat * dout, beta_i = sum of dout.
* The convolutions, in `conv.py`.
Layers without variables (UnitNormalization, pooling, activations, ...) need no rule.
Pure Python and tensor functions: eager or traced, any replica context, no communication.
"""
import dataclasses
import math
from typing import Callable

import keras
import tensorflow as tf

from trainer.per_example import conv
from trainer.per_example import terms

L = keras.layers


@dataclasses.dataclass(frozen=True)
class Rule:
  """How one Keras layer class is recorded.

  Attributes:
    slots: attribute names of the layer's variables ("kernel", "bias", ...).
    call: (layer, inputs, recording) -> outputs; registers outputs and terms on `recording`
      (`recording.watch(z) -> index`, `recording.add(variable, term)`).
    check: layer -> '' when the rule applies to this instance, else the reason it does not.
  """
  slots: tuple
  call: Callable
  check: Callable = lambda layer: ""


def common_check(layer) -> str:
  """Reasons shared by all rules: LoRA, quantization, rematerialisation, channels_first."""
  if getattr(layer, "lora_enabled", False):
    return "LoRA enabled"
  if getattr(layer, "quantization_mode", None):
    return f"quantized ({layer.quantization_mode})"
  if getattr(layer, "_remat_mode", None) is not None:
    return "rematerialization"
  if getattr(layer, "data_format", "channels_last") != "channels_last":
    return "channels_first"
  return ""


def static_prod(dims):
  """Product of static dims, or None when one is unknown."""
  return None if any(d is None for d in dims) else math.prod(dims)


def _activate(layer, z):
  return z if layer.activation is None else layer.activation(z)


# ------------------------------------------------------------------------------ Dense --------
def _dense_call(layer, inputs, rec):
  # Watched before the bias (same gradient; the forward graph stays Keras' own).
  z = keras.ops.matmul(inputs, layer.kernel)
  index = rec.watch(z)
  x = tf.cast(inputs, tf.float32)
  steps, width, units = static_prod(x.shape[1:-1]), x.shape[-1], z.shape[-1]
  terms.dense_like(rec, index, layer.kernel, layer.bias, lambda: terms.rows(x, [steps, width]),
             lambda dz: terms.rows(dz, [steps, units]), (steps, width, units),
             lambda w: tf.matmul(x, w), x.shape[0])
  if layer.bias is not None:
    z = keras.ops.add(z, layer.bias)
  return _activate(layer, z)


# ------------------------------------------------------------------------ EinsumDense --------
def einsum_parts(equation):
  """(inputs, kernel, output) subscripts when the batch letter leads and is explicit, else None.

  E.g. "abc,cde->abde": the batch letter 'a' leads the input and output and is not in the
  kernel. Ellipsis equations ("...b,bc->...c") and repeated letters are not covered.
  """
  if "." in equation or "->" not in equation:
    return None
  lhs, out = equation.split("->")
  if lhs.count(",") != 1:
    return None
  inputs, kernel = lhs.split(",")
  if not inputs or not out or inputs[0] != out[0] or inputs[0] in kernel:
    return None
  if any(len(set(s)) != len(s) for s in (inputs, kernel, out)):
    return None
  return inputs, kernel, out


def _einsum_check(layer):
  return "" if einsum_parts(layer.equation) else f"equation {layer.equation!r}"


def _arranged(t, subscripts, groups, dims):
  """`t` with axes `subscripts` as [B, *(product of each group's dims)] (transposed if needed)."""
  order = "".join(groups)
  if subscripts != order:
    t = tf.transpose(t, [subscripts.index(c) for c in order])
  return terms.rows(t, [static_prod([dims[c] for c in g]) for g in groups[1:]])


def _einsum_call(layer, inputs, rec):
  ins, ker, out = einsum_parts(layer.equation)
  z = keras.ops.einsum(layer.equation, inputs, layer.kernel)
  index = rec.watch(z)  # Before the bias, as for Dense.
  x = tf.cast(inputs, tf.float32)
  batch = out[0]
  positions = "".join(c for c in ins[1:] if c in out and c not in ker)
  contracted = "".join(c for c in ins if c in ker and c not in out)
  produced = "".join(c for c in ker if c in out and c not in ins)
  dims = dict(zip(out, z.shape)) | dict(zip(ins, x.shape)) | dict(zip(ker, layer.kernel.shape))
  forward = lambda w: tf.einsum(layer.equation, x, w)
  bias = layer.bias
  if (ker == contracted + produced and set(ins) == set(batch + positions + contracted)
      and set(out) == set(batch + positions + produced)):
    # "batch, positions, contracted -> batch, positions, produced": a Dense over positions.
    sizes = tuple(static_prod([dims[c] for c in s]) for s in (positions, contracted, produced))
    joint_bias = bias if bias is not None and tuple(bias.shape) == tuple(
        dims[c] for c in produced) else None
    terms.dense_like(rec, index, layer.kernel, joint_bias,
               lambda: _arranged(x, ins, (batch, positions, contracted), dims),
               lambda dz: _arranged(dz, out, (batch, positions, produced), dims), sizes,
               forward, x.shape[0])
    if joint_bias is not None or bias is None:
      return _activate(layer, keras.ops.add(z, bias) if bias is not None else z)
  else:
    rec.add(layer.kernel, terms.Term(
        index, lambda dz: tf.einsum(f"{ins},{out}->{batch}{ker}", x, dz),
        dots=terms.forward_dots(forward)))
  if bias is not None:
    # Keras' bias covers the output axes from the first bias axis on (1 for the others).
    first = min(out.index(c) for c in layer.bias_axes)
    kept = [k for k, c in enumerate(out) if k >= first and c in layer.bias_axes]
    summed = [k for k in range(1, len(out)) if k not in kept]
    rec.add(bias, terms.reduce_term(index, bias.shape, summed))
    z = keras.ops.add(z, bias)
  return _activate(layer, z)


# -------------------------------------------------------------------------- Embedding --------
def _embedding_call(layer, inputs, rec):
  if inputs.dtype not in (tf.int32, tf.int64):
    inputs = tf.cast(inputs, tf.int32)
  table = layer.embeddings
  vocab, dim = table.shape
  z = keras.ops.take(table, inputs, axis=0)  # Keras' lookup (negative ids wrap around).
  index = rec.watch(z)
  ids = tf.where(inputs < 0, inputs + vocab, inputs)
  steps = static_prod(ids.shape[1:])

  flat_ids = terms.rows(tf.cast(ids, tf.int32), [steps])

  def grads(dz):
    batch = tf.shape(dz)[0]
    segments = flat_ids + vocab * tf.range(batch)[:, None]
    g = tf.math.unsorted_segment_sum(tf.reshape(dz, [-1, dim]), tf.reshape(segments, [-1]),
                                     batch * vocab)
    return tf.reshape(g, [batch, vocab, dim])

  def gram_norms(dz):
    dz3 = terms.rows(dz, [steps, dim])
    same = tf.cast(tf.equal(flat_ids[:, :, None], flat_ids[:, None, :]), tf.float32)
    return tf.reduce_sum(same * tf.matmul(dz3, dz3, transpose_b=True), [1, 2])

  def forward(w):
    return tf.gather(w, ids)

  def batch_sum(dz):
    return tf.math.unsorted_segment_sum(tf.reshape(dz, [-1, dim]), tf.reshape(ids, [-1]), vocab)

  costs = None
  if steps is not None:
    costs = (steps * dim + terms.KEPT_FLOAT_COST * vocab * dim,
             steps * steps * (dim + 1) + steps * dim)
  rec.add(table, terms.Term(index, grads, gram_norms, terms.forward_dots(forward), batch_sum,
                            costs))
  return tf.cast(z, layer.compute_dtype)


# ---------------------------------------------------------------------- Normalization --------
def _affine(layer, rec, x_hat, channel_axes):
  """out = x_hat * gamma + beta (parameters along `channel_axes`), with their terms."""
  rank = x_hat.shape.rank
  shape = [1] * rank
  for axis in channel_axes:
    shape[axis] = x_hat.shape[axis]
  out = x_hat
  if layer.gamma is not None:
    out = out * tf.reshape(tf.cast(layer.gamma, tf.float32), shape)
  if layer.beta is not None:
    out = out + tf.reshape(tf.cast(layer.beta, tf.float32), shape)
  index = rec.watch(out)
  reduce_axes = [a for a in range(1, rank) if a not in channel_axes]
  if layer.gamma is not None:
    rec.add(layer.gamma, terms.reduce_term(index, layer.gamma.shape, reduce_axes, x_hat))
  if layer.beta is not None:
    rec.add(layer.beta, terms.reduce_term(index, layer.beta.shape, reduce_axes))
  if layer.gamma is not None and layer.beta is not None:
    def joint(dz):  # [B, 2, *parameter shape]: gamma's rows, then beta's.
      both = tf.stack([x_hat * dz, dz], axis=1)
      yield terms.flat(tf.reduce_sum(both, axis=[a + 1 for a in reduce_axes]))
    rec.add_joint(terms.Joint((layer.gamma, layer.beta), index, joint))
  return tf.cast(out, layer.compute_dtype)


def _layer_norm_check(layer):
  if getattr(layer, "rms_scaling", False):
    return "rms_scaling"
  axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
  return "normalises over the batch axis" if 0 in axes else ""


def _layer_norm_call(layer, inputs, rec):
  x = tf.cast(inputs, tf.float32)
  rank = x.shape.rank
  axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
  axes = sorted(a % rank for a in axes)
  x_hat = keras.ops.layer_normalization(x, None, None, axis=axes, epsilon=layer.epsilon)
  return _affine(layer, rec, x_hat, axes)


def _group_norm_call(layer, inputs, rec):
  x = tf.cast(inputs, tf.float32)
  rank = x.shape.rank
  axis = layer.axis % rank
  channels = x.shape[axis]
  dynamic = tf.shape(x)
  dims = [d if d is not None else dynamic[k] for k, d in enumerate(x.shape)]
  grouped = tf.reshape(x, dims[:axis] + [layer.groups, channels // layer.groups] + dims[axis + 1:])
  reduce_axes = [a for a in range(1, rank + 1) if a != axis]
  mean, variance = tf.nn.moments(grouped, axes=reduce_axes, keepdims=True)
  x_hat = tf.reshape((grouped - mean) * tf.math.rsqrt(variance + layer.epsilon), dynamic)
  return _affine(layer, rec, x_hat, [axis])


# --------------------------------------------------------------------------- Registry --------
RULES = {
    L.Dense: Rule(("kernel", "bias"), _dense_call),
    L.EinsumDense: Rule(("kernel", "bias"), _einsum_call, _einsum_check),
    L.Embedding: Rule(("embeddings",), _embedding_call),
    L.LayerNormalization: Rule(("gamma", "beta"), _layer_norm_call, _layer_norm_check),
    L.GroupNormalization: Rule(("gamma", "beta"), _group_norm_call),
}
for _types, _slots, _call, _check in conv.RULES:
  for _type in _types:
    RULES[_type] = Rule(_slots, _call, _check)


def rule_for(layer) -> tuple:
  """(rule, '') when `layer` has a direct formula, else (None, reason)."""
  rule = RULES.get(type(layer))
  if rule is None:
    return None, f"no direct formula for {type(layer).__name__}"
  reason = common_check(layer) or rule.check(layer)
  return (None, reason) if reason else (rule, "")


def layer_variables(layer, rule) -> list:
  """The layer's variables that the rule covers (absent ones skipped)."""
  out = []
  for slot in rule.slots:
    var = getattr(layer, slot, None)
    if var is not None:
      out.append(var)
  return out
