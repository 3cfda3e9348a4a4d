"""Direct per-example formulas for Keras convolutions, from the unfolded (im2col) input.

A convolution's kernel gradient for example i is sum_p u_ip dz_ip^T, where u_ip is the input
patch that output position p sees (the "unfolded" input) and dz_ip the output gradient there:
an outer-product term (`terms.outer_term`) with T = output positions, K = kernel taps x input
channels, O = filters. The patches come from strided slices of the padded input, one per kernel
tap, honouring strides, dilation and TF's padding rule (SAME puts the odd pixel at the end);
no Conv2DBackpropFilter runs.

Covered (exact classes, channels_last, groups = 1):
* `Conv1D` (incl. causal padding), `Conv2D`, `Conv3D`: u = patches of x, dz = output gradient.
* `Conv1DTranspose`, `Conv2DTranspose`, `Conv3DTranspose` without output_padding: a transposed
  convolution is the input-gradient of the convolution with the same kernel, so its kernel
  gradient is the same outer product with the roles swapped: patches of dz against x.
* `DepthwiseConv1D`, `DepthwiseConv2D`: per tap, dW[i, c, m] = sum_p x_ip[c] dz_ip[c, m].
* `SeparableConv1D`, `SeparableConv2D`: recorded as their two stages, a depthwise convolution
  u = dw(x) (its output u is watched too) and a pointwise product z = u P + b (a Dense over
  positions).
Dot products with a given gradient g use the forward operation at g: <conv(x; g), dz>.
Pure tensor functions: eager or traced, any replica context, no communication.
"""
import dataclasses
import itertools
import math

import keras
import numpy as np
import tensorflow as tf

from trainer.per_example import terms

L = keras.layers
ops = keras.ops

# Up to this many input channels one matmul over all patches wins; above it, one batched matmul
# per kernel tap does (small CNN, B=128: Cin=1 1.9 vs 3.3 ms, Cin=32 9.3 vs 12.5 ms; measured
# with stacked tap slices, which `_unfolded_by_conv` has since replaced).
ONE_PIECE_MAX_CHANNELS = 4


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Kernel size, strides, dilation and padding ('same' | 'valid') of a convolution."""
  kernel_size: tuple
  strides: tuple
  dilation: tuple
  padding: str

  @classmethod
  def of(cls, layer, padding=None):
    return cls(tuple(layer.kernel_size), tuple(layer.strides), tuple(layer.dilation_rate),
               padding or layer.padding)


def spatial_sizes(t):
  """Static spatial sizes of a channels_last tensor, dynamic where unknown."""
  dynamic = tf.shape(t)
  return [d if d is not None else dynamic[k + 1] for k, d in enumerate(t.shape[1:-1])]


def positions(t):
  """Static number of spatial positions of a channels_last tensor, or None."""
  dims = t.shape[1:-1]
  return None if any(d is None for d in dims) else math.prod(dims)


def shifted(x, geom, out_sizes):
  """Per kernel tap (row-major), the input pixels that tap multiplies, lined up with outputs.

  Each slice is [B, *out_sizes, C].
  """
  rank = len(geom.kernel_size)
  if geom.padding == "same":
    pads = [[0, 0] for _ in range(rank + 2)]
    for d in range(rank):
      size = x.shape[1 + d] if x.shape[1 + d] is not None else tf.shape(x)[1 + d]
      k, s, r, o = geom.kernel_size[d], geom.strides[d], geom.dilation[d], out_sizes[d]
      total = (o - 1) * s + (k - 1) * r + 1 - size
      total = max(total, 0) if isinstance(total, int) else tf.maximum(total, 0)
      pads[1 + d] = [total // 2, total - total // 2]
    x = tf.pad(x, pads)
  for tap in itertools.product(*[range(k) for k in geom.kernel_size]):
    index = [slice(None)] * (rank + 2)
    for d, j in enumerate(tap):
      start = j * geom.dilation[d]
      index[1 + d] = slice(start, start + (out_sizes[d] - 1) * geom.strides[d] + 1,
                           geom.strides[d])
    yield x[tuple(index)]


def unfold(x, geom, out_sizes):
  """[B, P, taps * C] patches, in the (taps, C) order of a kernel [*kernel_size, C, ...]."""
  cols = tf.concat(list(shifted(x, geom, out_sizes)), axis=-1)
  return terms.rows(cols, [positions(cols), math.prod(geom.kernel_size) * x.shape[-1]])


def filter_grad_blocks(inputs, out_grads, geom, bias_row=False):
  """Per-example sum_p patches(inputs)_p^T out_grads_p (channels_last), as row-major pieces.

  Yields [B, n] float32 pieces: with few input channels one piece [B, taps * C * O] (one matmul
  over all patches, see `_unfolded_by_conv`), else one [B, C * O] piece per kernel tap (one
  batched matmul each). A generator: each tap's slice is taken when the consumer asks for it,
  inside the consumer's control dependencies, so a consumer can bound how many taps are alive.
  With `bias_row` (only with few channels, see `one_piece`), the piece has O more columns at
  its end: sum_p out_grads_p, the bias gradient, from a patch channel of ones in the same matmul.
  """
  channels, filters = inputs.shape[-1], out_grads.shape[-1]
  out_sizes = spatial_sizes(out_grads)
  steps = positions(out_grads)
  g3 = terms.rows(out_grads, [steps, filters])
  if one_piece(inputs):
    width = math.prod(geom.kernel_size) * channels + int(bias_row)
    patches = _unfolded_by_conv(inputs, geom, out_sizes, bias_row)
    g = tf.matmul(terms.rows(patches, [steps, width]), g3, transpose_a=True)
    yield terms.rows(g, [width * filters])
    return
  if bias_row:
    raise ValueError("filter_grad_blocks: bias_row needs few input channels (see one_piece)")
  for tap in shifted(inputs, geom, out_sizes):
    product = tf.matmul(terms.rows(tap, [steps, channels]), g3, transpose_a=True)
    yield terms.rows(product, [channels * filters])


def one_piece(inputs) -> bool:
  """Whether `filter_grad_blocks` makes one piece (few input channels) rather than one per tap."""
  return inputs.shape[-1] <= ONE_PIECE_MAX_CHANNELS


def _unfolded_by_conv(x, geom, out_sizes, ones_channel=False):
  """The unfolded input [B, *out_sizes, taps * C] in (tap, channel) order, as ONE convolution
  of x with a 0/1 kernel that copies each tap's channel to its own output channel (exact: every
  output is one input times 1). No per-tap slices exist at once, unlike stacking them (small
  CNN, B=512: 16 MiB less peak memory for the first Conv2D). The geometry is the layer's own,
  which TF's convolution took in the forward pass. `ones_channel` appends a channel of ones
  (zero kernel, bias 1).
  """
  channels, taps = x.shape[-1], math.prod(geom.kernel_size)
  width = taps * channels + int(ones_channel)
  copy = np.zeros(list(geom.kernel_size) + [channels, width], np.float32)
  for t, tap in enumerate(itertools.product(*[range(k) for k in geom.kernel_size])):
    for c in range(channels):
      copy[tap + (c, t * channels + c)] = 1.0
  out = tf.nn.convolution(tf.cast(x, tf.float32), tf.constant(copy), strides=list(geom.strides),
                          padding=geom.padding.upper(), dilations=list(geom.dilation))
  if ones_channel:
    out = tf.nn.bias_add(out, tf.constant([0.0] * (width - 1) + [1.0]))
  static = [d for d in out_sizes if isinstance(d, int)]
  if len(static) == len(out_sizes) and out.shape[1:-1].as_list() != static:
    raise ValueError(f"per_example: unfolding a {geom} convolution gave positions "
                     f"{out.shape[1:-1]}, expected {static}")
  return out


def _add_bias(layer, rec, z):
  """Watches z (before the bias: same gradient, and the forward graph stays Keras' own, which
  grappler fuses into conv+bias+activation), then adds the bias as Keras does and registers its
  term. Returns (z + bias, index of z)."""
  index = rec.watch(z)
  if not layer.use_bias:
    return z, index
  rec.add(layer.bias, terms.reduce_term(index, layer.bias.shape, list(range(1, z.shape.rank - 1))))
  return ops.add(z, ops.reshape(layer.bias, (1,) * (z.shape.rank - 1) + (-1,))), index


def _activate(layer, z):
  return z if layer.activation is None else layer.activation(z)


def _kernel_terms(layer, rec, index, x, geom, forward, sizes, transposed=False):
  """Kernel outer-product term (patches of x against dz, or of dz against x when `transposed`)
  and, with a bias, their joint: the kernel pieces, then the bias piece."""
  kernel = layer.kernel

  def roles(dz):
    return (dz, x) if transposed else (x, dz)

  def pair(dz):
    patches, other = roles(dz)
    return (unfold(patches, geom, spatial_sizes(other)),
            terms.rows(other, [positions(other), other.shape[-1]]))

  def blocks(dz):
    return filter_grad_blocks(*roles(dz), geom)

  def materialize(dz):
    return tf.reshape(tf.concat(list(blocks(dz)), axis=1), [-1] + list(kernel.shape))
  rec.add(kernel, terms.outer_term(index, pair, kernel.shape, forward, sizes, materialize,
                                   blocks, x.shape[0]))
  if layer.use_bias:
    def joint(dz):
      if not transposed and one_piece(x):  # The bias row from the same matmul.
        yield from filter_grad_blocks(x, dz, geom, bias_row=True)
        return
      yield from blocks(dz)
      yield tf.reduce_sum(dz, axis=list(range(1, dz.shape.rank - 1)))
    rec.add_joint(terms.Joint((kernel, layer.bias), index, joint))


# --------------------------------------------------------------------- Conv1D/2D/3D ----------
def _conv_check(layer):
  return f"groups={layer.groups}" if getattr(layer, "groups", 1) != 1 else ""


def _conv_call(layer, inputs, rec):
  padding = layer.padding
  if padding == "causal":  # Conv1D: pad on the left, then a VALID convolution (as Keras does).
    inputs = ops.pad(inputs, layer._compute_causal_padding())  # pylint: disable=protected-access
    padding = "valid"
  conv = lambda t, w: ops.conv(t, w, strides=list(layer.strides), padding=padding,
                               dilation_rate=layer.dilation_rate, data_format=layer.data_format)
  z = conv(inputs, layer.kernel)
  z, index = _add_bias(layer, rec, z)
  x = tf.cast(inputs, tf.float32)
  geom = Geometry.of(layer, padding)
  sizes = (positions(z), math.prod(geom.kernel_size) * x.shape[-1], layer.filters)
  _kernel_terms(layer, rec, index, x, geom, lambda w: conv(x, w), sizes)
  return _activate(layer, z)


# ------------------------------------------------------------------ Conv*DTranspose ----------
def _transpose_check(layer):
  return "output_padding" if layer.output_padding is not None else ""


def _transpose_call(layer, inputs, rec):
  conv_t = lambda t, w: ops.conv_transpose(
      t, w, strides=list(layer.strides), padding=layer.padding, output_padding=None,
      data_format=layer.data_format, dilation_rate=layer.dilation_rate)
  z = conv_t(inputs, layer.kernel)
  z, index = _add_bias(layer, rec, z)
  x = tf.cast(inputs, tf.float32)
  geom = Geometry.of(layer)
  sizes = (positions(x), math.prod(geom.kernel_size) * layer.filters, x.shape[-1])
  _kernel_terms(layer, rec, index, x, geom, lambda w: conv_t(x, w), sizes, transposed=True)
  return _activate(layer, z)


# ------------------------------------------------------------ Depthwise / Separable ----------
def _depthwise_term(index, kernel, x, geom):
  """Per-example depthwise kernel gradients [B, *k, C, m] (always materialised: small)."""
  channels, multiplier = kernel.shape[-2], kernel.shape[-1]

  def grads(du):
    steps = positions(du)
    du4 = terms.rows(du, [steps, channels, multiplier])
    per_tap = [tf.reduce_sum(terms.rows(s, [steps, channels, 1]) * du4, axis=1)
               for s in shifted(x, geom, spatial_sizes(du))]
    return terms.rows(tf.stack(per_tap, axis=1), list(kernel.shape))
  return terms.Term(index, grads)


def _depthwise_stage(layer, inputs, kernel):
  u = ops.depthwise_conv(inputs, kernel, strides=layer.strides, padding=layer.padding,
                         dilation_rate=layer.dilation_rate, data_format=layer.data_format)
  return u, tf.cast(inputs, tf.float32), Geometry.of(layer)


def _depthwise_call(layer, inputs, rec):
  z, x, geom = _depthwise_stage(layer, inputs, layer.kernel)
  z, index = _add_bias(layer, rec, z)
  rec.add(layer.kernel, _depthwise_term(index, layer.kernel, x, geom))
  return _activate(layer, z)


def _separable_call(layer, inputs, rec):
  u, x, geom = _depthwise_stage(layer, inputs, layer.depthwise_kernel)
  u_index = rec.watch(u)
  rec.add(layer.depthwise_kernel, _depthwise_term(u_index, layer.depthwise_kernel, x, geom))
  width = u.shape[-1]
  pointwise = layer.pointwise_kernel
  z = ops.matmul(u, ops.reshape(pointwise, (width, layer.filters)))
  index = rec.watch(z)
  uf = tf.cast(u, tf.float32)
  steps = positions(u)
  # The pointwise stage is a Dense over positions; its kernel [1, (1,) C m, filters] is (K, O).
  terms.dense_like(rec, index, pointwise, layer.bias if layer.use_bias else None,
                   lambda: terms.rows(uf, [steps, width]),
                   lambda dz: terms.rows(dz, [steps, layer.filters]), (steps, width, layer.filters),
                   lambda w: tf.matmul(uf, tf.reshape(w, (width, layer.filters))), x.shape[0])
  if layer.use_bias:
    z = ops.add(z, ops.reshape(layer.bias, (1,) * (z.shape.rank - 1) + (-1,)))
  return _activate(layer, z)


# (classes, variable slots, call, check) for layers.RULES.
RULES = (
    ((L.Conv1D, L.Conv2D, L.Conv3D), ("kernel", "bias"), _conv_call, _conv_check),
    ((L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose), ("kernel", "bias"),
     _transpose_call, _transpose_check),
    ((L.DepthwiseConv1D, L.DepthwiseConv2D), ("kernel", "bias"), _depthwise_call,
     lambda layer: ""),
    ((L.SeparableConv1D, L.SeparableConv2D), ("depthwise_kernel", "pointwise_kernel", "bias"),
     _separable_call, lambda layer: ""),
)
COVERED = tuple(t for types, *_ in RULES for t in types)
