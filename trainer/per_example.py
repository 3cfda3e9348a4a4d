"""Per-example gradients, vectorized, for any training loop.

`per_example_gradients(model, loss_fn, batch)` returns, for every variable, a tensor
`[B_local, *var.shape]` whose row i is the gradient of example i's loss alone. It runs eagerly
or traced (inside `tf.function`), in cross-replica context or in replica context (inside
`strategy.run`, where B_local is the replica's share of the batch); it never communicates.

Two paths, chosen per variable when the function is called (at trace time inside tf.function):

* Direct path (Keras `Dense`, `EinsumDense` with a leading explicit batch letter (e.g. the
  projections of `MultiHeadAttention`), `Conv2D`, `DepthwiseConv2D`; channels_last, no LoRA, no
  quantization, no remat, groups=1). One ordinary batch forward runs under a GradientTape while
  these layers' `call` is temporarily replaced by an equivalent one that records the layer input
  x and its pre-activation output z. One backward pass gives dz = d(sum_i loss_i)/dz; since z's
  row i only reaches loss_i, row i of dz is example i's gradient, and the weight gradients follow
  exactly from x and dz: Dense dW_i = x_i^T dz_i, Conv dW_i = patches(x_i)^T dz_i (im2col by
  strided slices of the padded input, honouring strides, dilation and SAME/VALID padding), bias
  db_i = dz_i summed over positions. No Conv2DBackpropFilter runs at all.
* General path (every other variable: Embedding, LayerNormalization, custom layers, ...).
  `tf.vectorized_map` (pfor) of the gradient of one example's loss, i.e. the loop of
  single-example GradientTapes, vectorized.

Semantics and limits:
* Examples must not interact in the forward pass (the loss of example i depends only on example
  i). BatchNormalization in training mode breaks this: it is refused with a ValueError. Run BN
  with `training=False` or freeze it (`layer.trainable = False`).
* Dropout and other random layers: the direct path uses the masks drawn by its single batch
  forward, so the per-example gradients are those of that forward pass and they sum exactly to
  the batch gradient of the same pass (same seed state). The general path runs its own forward
  (one example at a time) and draws its own masks; with random layers and general-path
  variables the two paths see different draws.
* A direct-path variable must be used only through its layer's `call` (no weight tying through
  other code paths): contributions made elsewhere are not seen by the direct formulas.
* Memory: the result holds B x (number of parameters) floats. `chunk_size` bounds the
  intermediate memory (patches, pfor activations) by processing the batch in chunks inside a
  `tf.while_loop`; the result is identical to the unchunked one.
"""
import contextlib
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

_BN_TYPES = (keras.layers.BatchNormalization,)
_MISSING = object()


def _unwrap(v):
  """The tf.Variable (or DistributedVariable) behind a Keras variable; others unchanged."""
  return v.value if isinstance(v, keras.Variable) else v


def _key(v) -> int:
  return id(_unwrap(v))


def _direct_kind(layer) -> str:
  """'dense', 'einsum', 'conv2d' or 'depthwise2d' when a direct formula applies, else ''."""
  if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
    return ""
  if getattr(layer, "_remat_mode", None) is not None:
    return ""
  kind = type(layer)
  if kind is keras.layers.Dense:
    return "dense"
  if kind is keras.layers.EinsumDense and _einsum_parts(layer.equation) is not None:
    return "einsum"
  if getattr(layer, "data_format", "channels_last") != "channels_last":
    return ""
  if kind is keras.layers.Conv2D and getattr(layer, "groups", 1) == 1:
    return "conv2d"
  if kind is keras.layers.DepthwiseConv2D:
    return "depthwise2d"
  return ""


def _einsum_parts(equation):
  """(inputs, kernel, output) subscripts when the batch axis is explicit and leading, else None.

  E.g. "abc,cde->abde": the batch letter 'a' leads the input and output and is not in the kernel.
  Ellipsis equations ("...b,bc->...c") use the general path.
  """
  if "." in equation or "->" not in equation:
    return None
  lhs, out = equation.split("->")
  if lhs.count(",") != 1:
    return None
  inputs, kernel = lhs.split(",")
  if not inputs or not out or inputs[0] != out[0] or inputs[0] in kernel:
    return None
  return inputs, kernel, out


def _flat_layers(model) -> list:
  """The model and all its nested Keras layers; [] for non-Keras models (general path only)."""
  if not isinstance(model, keras.layers.Layer):
    return []
  return model._flatten_layers(include_self=True, recursive=True)  # pylint: disable=protected-access


def _plan(model, variables):
  """Splits `variables` into direct-path layers and general-path indices (Python, at trace time).

  Returns (direct, general): direct is a list of (layer, kind, {"kernel": i, "bias": j}) with i/j
  indices into `variables`; general is the sorted list of the remaining indices.
  """
  index = {}
  for i, v in enumerate(variables):
    index.setdefault(_key(v), i)
  direct, covered = [], set()
  for layer in _flat_layers(model):
    kind = _direct_kind(layer)
    if not kind:
      continue
    slots = {}
    for name in ("kernel", "bias"):
      var = getattr(layer, name, None)
      if var is not None and _key(var) in index:
        slots[name] = index[_key(var)]
    if slots:
      direct.append((layer, kind, slots))
      covered.update(slots.values())
  general = [i for i in range(len(variables)) if i not in covered]
  return direct, general


def _pre_activation(layer, kind, x):
  """The layer's output before its activation, computed as Keras' own `call` does."""
  ops = keras.ops
  if kind in ("dense", "einsum"):
    if kind == "dense":
      z = ops.matmul(x, layer.kernel)
    else:
      z = ops.einsum(layer.equation, x, layer.kernel)
    return z if layer.bias is None else ops.add(z, layer.bias)
  if kind == "conv2d":
    z = layer.convolution_op(x, layer.kernel)
  else:
    z = ops.depthwise_conv(x, layer.kernel, strides=layer.strides, padding=layer.padding,
                           dilation_rate=layer.dilation_rate, data_format=layer.data_format)
  if layer.use_bias:
    z = ops.add(z, ops.reshape(layer.bias, (1, 1, 1, -1)))
  return z


def _training_flag(args, kwargs):
  if "training" in kwargs:
    return kwargs["training"]
  return args[1] if len(args) > 1 else None


@contextlib.contextmanager
def _patched_calls(layers, records, tape, guard_bn):
  """Temporarily replaces `call` on the given direct layers (recording x, z) and on BN layers.

  Python-level only: inside tf.function it acts while tracing; always restores what was there.
  Under MirroredStrategy replica functions take turns between sync points (merge_call), and the
  forward pass has none, so replicas never see each other's patches.
  """
  patched = []

  def recording_call(layer, kind):
    def call(inputs, *unused_args, **unused_kwargs):
      z = _pre_activation(layer, kind, inputs)
      if tape is not None:
        tape.watch(z)
      records[id(layer)].append((inputs, z))
      return z if layer.activation is None else layer.activation(z)
    return call

  def refusing_call(layer, original):
    def call(*args, **kwargs):
      training = _training_flag(args, kwargs)
      if layer.trainable and training is not None and (
          not isinstance(training, bool) or training):
        raise ValueError(
            f"per_example_gradients: BatchNormalization layer '{layer.name}' runs with "
            "training=True (batch statistics mix examples, so per-example gradients are "
            "ill-defined); call it with training=False, set layer.trainable=False, or use "
            "LayerNormalization/GroupNormalization.")
      return original(*args, **kwargs)
    return call

  def patch(layer, call):
    patched.append((layer, layer.__dict__.get("call", _MISSING)))
    object.__setattr__(layer, "call", call)  # Bypasses Keras attribute tracking.

  try:
    for layer, kind in layers:
      patch(layer, recording_call(layer, kind))
    for layer in guard_bn:
      patch(layer, refusing_call(layer, layer.call))
    yield
  finally:
    for layer, previous in reversed(patched):
      if previous is _MISSING:
        object.__delattr__(layer, "call")
      else:
        object.__setattr__(layer, "call", previous)


def _dense_grads(layer, x, dz):
  """Per-example Dense grads: outer products x_i dz_i^T (summed over middle axes), bias dz_i."""
  del layer
  x = tf.cast(x, tf.float32)
  dz = tf.cast(dz, tf.float32)
  if x.shape.rank == 2:
    kernel = tf.matmul(x[:, :, None], dz[:, None, :])  # Outer products; ~= einsum, < bcast.
    bias = dz
  else:
    batch = tf.shape(x)[0]
    x3 = tf.reshape(x, [batch, -1, x.shape[-1]])
    dz3 = tf.reshape(dz, [batch, -1, dz.shape[-1]])
    kernel = tf.matmul(x3, dz3, transpose_a=True)
    bias = tf.reduce_sum(dz3, axis=1)
  return kernel, bias


def _shifted_inputs(layer, x, out_hw, channels_first=False):
  """Yields, per kernel offset (row-major over kh, kw), the input pixels that offset multiplies.

  Im2col by strided slices of the (SAME-padded) input: each slice is [B, OH, OW, Cin] ([B, Cin,
  OH, OW] when `channels_first`, x then being NCHW) and lines up with the output positions. Same
  padding rule as TF convolutions (the extra pixel goes at the end). Cheaper on CPU than
  `tf.image.extract_patches` (measured 1.9 vs 6.2 ms for B=128, 28x28x1, 3x3).
  """
  kh, kw = layer.kernel_size
  sh, sw = layer.strides
  dh, dw = layer.dilation_rate
  oh, ow = out_hw
  h_axis = 2 if channels_first else 1
  if layer.padding == "same":
    pads = [[0, 0], [0, 0], [0, 0], [0, 0]]
    for axis, k, s, d, o in ((h_axis, kh, sh, dh, oh), (h_axis + 1, kw, sw, dw, ow)):
      size = x.shape[axis] if x.shape[axis] is not None else tf.shape(x)[axis]
      total = tf.maximum((o - 1) * s + (k - 1) * d + 1 - size, 0)
      pads[axis] = [total // 2, total - total // 2]
    x = tf.pad(x, pads)
  for i in range(kh):
    for j in range(kw):
      rows = slice(i * dh, i * dh + (oh - 1) * sh + 1, sh)
      cols = slice(j * dw, j * dw + (ow - 1) * sw + 1, sw)
      yield x[:, :, rows, cols] if channels_first else x[:, rows, cols, :]


def _spatial(dz):
  dims = dz.shape[1:3]
  dynamic = tf.shape(dz)[1:3]
  return [d if d is not None else dynamic[k] for k, d in enumerate(dims)]


# Below this many input channels one big matmul over a stacked channels-first im2col wins;
# above it, one batched matmul per kernel offset does (measured on the small CNN: Cin=1 1.9 vs
# 3.3 ms, Cin=32 9.3 vs 12.5 ms at B=128).
_STACKED_IM2COL_MAX_CIN = 4


def _conv_grads(layer, x, dz):
  """Per-example Conv2D grads dW_b = im2col(x_b)^T dz_b, bias = dz summed over positions."""
  x = tf.cast(x, tf.float32)
  dz = tf.cast(dz, tf.float32)
  batch = tf.shape(x)[0]
  cin, cout = x.shape[-1], dz.shape[-1]
  dz3 = tf.reshape(dz, [batch, -1, cout])
  if cin <= _STACKED_IM2COL_MAX_CIN:
    nchw = tf.transpose(x, [0, 3, 1, 2])
    cols = tf.stack([tf.reshape(xs, [batch, cin, -1])
                     for xs in _shifted_inputs(layer, nchw, _spatial(dz), True)], axis=1)
    kernel = tf.matmul(tf.reshape(cols, [batch, -1, tf.shape(dz3)[1]]), dz3)
  else:
    kernel = tf.stack([tf.matmul(tf.reshape(xs, [batch, -1, cin]), dz3, transpose_a=True)
                       for xs in _shifted_inputs(layer, x, _spatial(dz))], axis=1)
  kernel = tf.reshape(kernel, tf.concat([[batch], layer.kernel.shape], 0))
  return kernel, tf.reduce_sum(dz3, axis=1)


def _depthwise_grads(layer, x, dz):
  """Per-example DepthwiseConv2D grads: per offset, dW[b,c,m] = sum_p x[b,p,c] dz[b,p,c,m]."""
  x = tf.cast(x, tf.float32)
  dz = tf.cast(dz, tf.float32)
  batch = tf.shape(x)[0]
  kh, kw, cin, mult = layer.kernel.shape
  dz4 = tf.reshape(dz, [batch, -1, cin, mult])
  per_offset = [tf.einsum("bpc,bpcm->bcm", tf.reshape(xs, [batch, -1, cin]), dz4)
                for xs in _shifted_inputs(layer, x, _spatial(dz))]
  kernel = tf.reshape(tf.stack(per_offset, axis=1), [batch, kh, kw, cin, mult])
  return kernel, tf.reduce_sum(tf.reshape(dz, [batch, -1, cin * mult]), axis=1)


def _einsum_grads(layer, x, dz):
  """Per-example EinsumDense grads: the kernel-gradient einsum with the batch letter kept."""
  inputs, kernel, out = _einsum_parts(layer.equation)
  x = tf.cast(x, tf.float32)
  dz = tf.cast(dz, tf.float32)
  batch = out[0]
  kernel_grad = tf.einsum(f"{inputs},{out}->{batch}{kernel}", x, dz)
  bias_grad = None
  if layer.bias is not None:
    # Keras' bias covers the output axes from the first bias axis on, with 1 for the others.
    first = min(out.index(c) for c in layer.bias_axes)
    kept = "".join(c for c in out[first:] if c in layer.bias_axes)
    bias_grad = tf.einsum(f"{out}->{batch}{kept}", dz)
    bias_grad = tf.reshape(bias_grad, tf.concat([tf.shape(dz)[:1], layer.bias.shape], 0))
  return kernel_grad, bias_grad


_FORMULAS = {"dense": _dense_grads, "einsum": _einsum_grads, "conv2d": _conv_grads,
             "depthwise2d": _depthwise_grads}


def _check_losses(losses):
  losses = tf.convert_to_tensor(losses)
  if losses.shape.rank != 1:
    raise ValueError(
        f"loss_fn must return per-example losses of shape [B]; got shape {losses.shape}.")
  return losses


def _direct_pass(model, loss_fn, batch, direct, variables, bn_layers):
  """One batch forward + one backward to the recorded pre-activations; returns {index: grad}."""
  records = {id(layer): [] for layer, _, _ in direct}
  with tf.GradientTape(watch_accessed_variables=False) as tape:
    with _patched_calls([(l, k) for l, k, _ in direct], records, tape, bn_layers):
      losses = _check_losses(loss_fn(model, batch))
    total = tf.reduce_sum(tf.cast(losses, tf.float32))
  zs = [z for layer, _, _ in direct for _, z in records[id(layer)]]
  dzs = iter(tape.gradient(total, zs, unconnected_gradients=tf.UnconnectedGradients.ZERO))
  out = {}
  for layer, kind, slots in direct:
    calls = records[id(layer)]
    if not calls:  # Layer not used by this loss: its gradient is zero.
      batch_size = tf.shape(losses)[0]
      for i in slots.values():
        out[i] = tf.zeros(tf.concat([[batch_size], variables[i].shape], 0), variables[i].dtype)
      continue
    sums = None
    for x, _ in calls:
      grads = _FORMULAS[kind](layer, x, next(dzs))
      sums = grads if sums is None else tuple(
          None if a is None else a + b for a, b in zip(sums, grads))
    for name, i in slots.items():
      out[i] = tf.cast(sums[0 if name == "kernel" else 1], variables[i].dtype)
  return out


def _general_pass(model, loss_fn, batch, general, variables, bn_layers):
  """tf.vectorized_map of one example's gradient for the variables in `general`."""
  targets = [variables[i] for i in general]

  def one_example(example):
    example = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), example)
    with tf.GradientTape() as tape:
      tape.watch([_unwrap(v) for v in targets])
      with _patched_calls([], {}, None, bn_layers):
        loss = tf.reduce_sum(_check_losses(loss_fn(model, example)))
    grads = tape.gradient(loss, targets, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [tf.convert_to_tensor(g) for g in grads]

  grads = tf.vectorized_map(one_example, batch)
  return dict(zip(general, grads))


def _unchunked(model, loss_fn, batch, variables, plan, bn_layers):
  direct, general = plan
  out = {}
  if direct:
    out.update(_direct_pass(model, loss_fn, batch, direct, variables, bn_layers))
  if general:
    out.update(_general_pass(model, loss_fn, batch, general, variables, bn_layers))
  return [out[i] for i in range(len(variables))]


def _chunked(model, loss_fn, batch, variables, plan, bn_layers, chunk_size):
  """Runs `_unchunked` on slices of `chunk_size` examples in a tf.while_loop; concatenates."""
  size = tf.shape(tf.nest.flatten(batch)[0])[0]
  num_chunks = (size + chunk_size - 1) // chunk_size
  arrays = [tf.TensorArray(v.dtype, size=num_chunks, infer_shape=False,
                           element_shape=tf.TensorShape([None]).concatenate(v.shape))
            for v in variables]

  def body(k, arrays):
    start = k * chunk_size
    chunk = tf.nest.map_structure(lambda t: t[start:start + chunk_size], batch)
    grads = _unchunked(model, loss_fn, chunk, variables, plan, bn_layers)
    return k + 1, [a.write(k, g) for a, g in zip(arrays, grads)]

  _, arrays = tf.while_loop(lambda k, _: k < num_chunks, body, (tf.constant(0), arrays))
  return [a.concat() for a in arrays]


def per_example_gradients(model: Any, loss_fn: Callable[[Any, Any], tf.Tensor], batch: Any, *,
                          variables: Sequence[Any] | None = None,
                          chunk_size: int = 0) -> list[tf.Tensor]:
  """Per-example gradients of `loss_fn(model, batch)` ([B] losses) w.r.t. `variables`.

  Eager or traced; replica or cross-replica context (no communication). See the module
  docstring for the direct/general paths, BatchNorm and Dropout semantics.

  Args:
    model: a Keras 3 model/layer (its Dense/EinsumDense/Conv2D/DepthwiseConv2D layers use the
      direct path),
      or any object exposing `trainable_variables` (general path only).
    loss_fn: `loss_fn(model, batch) -> [B]` per-example losses; it chooses `training=`.
    batch: a tensor or nest of tensors, all with leading dimension B.
    variables: defaults to `model.trainable_variables`.
    chunk_size: 0 processes the batch at once; k > 0 processes k examples at a time in a
      tf.while_loop (same result, less intermediate memory).

  Returns:
    One tensor `[B, *var.shape]` per variable, in the order of `variables`.
  """
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 0:
    raise ValueError(f"chunk_size must be an int >= 0 (0: no chunking); got {chunk_size!r}.")
  variables = list(model.trainable_variables if variables is None else variables)
  if not variables:
    return []
  plan = _plan(model, variables)
  bn_layers = [l for l in _flat_layers(model) if isinstance(l, _BN_TYPES)]
  static_size = tf.nest.flatten(batch)[0].shape[0]
  if chunk_size == 0 or (static_size is not None and static_size <= chunk_size):
    return _unchunked(model, loss_fn, batch, variables, plan, bn_layers)
  return _chunked(model, loss_fn, batch, variables, plan, bn_layers, chunk_size)
