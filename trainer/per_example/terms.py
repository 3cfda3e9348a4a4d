"""A `Term`: what one recorded layer call contributes to one variable's per-example gradient.

Pure tensor functions; they run eagerly or traced, in any replica context, and never
communicate. Every direct formula in `layers.py` and `conv.py` is expressed as terms.

A recorded call produces an output z (the layer's linear part before bias and activation, or
any tensor the formulas need) whose gradient dz = d(sum_i c_i loss_i)/dz the caller obtains from its own backward pass;
row i of dz belongs to example i alone. A term turns dz into:

* `grads(dz)`: the per-example gradients [B, *var.shape] (materialised);
* `gram_norms(dz)` (optional): their squared norms [B] without materialising them;
* `batch_sum(dz)` (optional): sum_i g_i without materialising the g_i;
* `dots(dz, g)` (optional): their dot products with a given gradient g [B], without
  materialising them. Where this exists it is <forward(x; g), dz>: the recorded outputs are
  linear in the variable, so replacing the variable by g in the forward formula and taking the
  per-example inner product with dz gives <g_i, g>.

Most per-example gradients are linear maps of a sum over positions t of an outer product,
g_i = sum_t a_it b_it^T with a_i [T, K] and b_i [T, O] (`outer_term`). Its squared norm is then
either |g_i|^2 after materialising g_i (T K O multiply-adds, K O floats kept per example) or,
the Gram trick, <a_i a_i^T, b_i b_i^T> (T^2 (K + O) multiply-adds, nothing kept; for T = 1 just
|a_i|^2 |b_i|^2). `costs` carries both estimates so the caller can choose.

A `Joint` covers several variables of one layer call at once (kernel and bias, gamma and beta):
its pieces, concatenated, are their flattened per-example gradients in layout order, e.g. the
kernel's outer products, then the bias' sum over positions. The statistics reduce the pieces of
a group together. (Appending a column of ones to the input, so that one matmul yields the bias
row too, was dropped: the odd inner size K + 1 made oneDNN's batched matmul and the copy cost
more than the separate sum, 0.3 ms of 3.4 ms on the text Transformer at B = 128.)
"""
import dataclasses
from typing import Callable

import tensorflow as tf

# Cost model, in multiply-add units. A materialised per-example float is written once and read
# for the norm, the batch sum and the dot: KEPT_FLOAT_COST. Every executed op costs a fixed
# OP_COST (thread-pool dispatch, ~10 us on 2 CPU cores: small layers are cheaper materialised
# into the statistics' shared matrix, 1 matmul, than by their ~8 Gram and forward ops).
# Measured on 2 CPU cores: the small CNN's Dense 1600x128 (T = 1) is cheaper by Gram, the text
# Transformer's 16-position 32x32 projections and its 32x2 head cheaper materialised.
KEPT_FLOAT_COST = 8.0
OP_COST = 2e5
MATERIALIZE_OPS, GHOST_OPS = 3, 9
ASSUMED_BATCH = 64  # For the cost model when the batch size is not static.


def choice_costs(batch, steps, k, o):
  """(materialise, ghost) total cost estimates of an outer-product term, or None."""
  if steps is None:
    return None
  batch = batch or ASSUMED_BATCH
  materialise = batch * (steps * k * o + KEPT_FLOAT_COST * k * o) + MATERIALIZE_OPS * OP_COST
  ghost = batch * (steps * steps * (k + o) + steps * k * o) + GHOST_OPS * OP_COST
  return materialise, ghost


@dataclasses.dataclass(frozen=True)
class Term:
  """One variable's per-example gradient from one recorded output.

  Attributes:
    output: index of the recorded output whose gradient dz drives this term.
    grads: dz -> [B, *var.shape] float32 per-example gradients.
    gram_norms: dz -> [B] squared norms without materialising, or None.
    dots: (dz, g) -> [B] dot products with g (shaped like the variable), or None.
    batch_sum: dz -> sum_i g_i (shaped like the variable) without materialising, or None.
    costs: per-example (materialise, ghost) cost estimates, or None (then materialise).
    blocks: dz -> iterable of [B, n_k] float32 pieces of the flattened per-example gradients,
      in row-major order (e.g. one per kernel tap; a generator may create each piece only when
      asked), or None (one piece: `grads`, flattened).
  """
  output: int
  grads: Callable
  gram_norms: Callable | None = None
  dots: Callable | None = None
  batch_sum: Callable | None = None
  costs: tuple | None = None
  blocks: Callable | None = None

  @property
  def prefers_ghost(self) -> bool:
    return (self.gram_norms is not None and self.costs is not None
            and self.costs[1] < self.costs[0])


def rows(t, trailing):
  """Reshapes [B, ...] to [B, *trailing]; `trailing` may hold one -1 (then B is read)."""
  trailing = [int(d) if d is not None else -1 for d in trailing]
  if t.shape[1:].as_list() == trailing:
    return t
  if -1 not in trailing:
    return tf.reshape(t, [-1] + trailing)
  batch = t.shape[0] if t.shape[0] is not None else tf.shape(t)[0]
  return tf.reshape(t, [batch] + trailing)


def flat(t):
  """[B, ...] -> [B, N] float32."""
  n = t.shape[1:].num_elements()
  return rows(tf.cast(t, tf.float32), [n if n is not None else -1])


def reduce_term(output, shape, reduce_axes, weight=None):
  """Per-example gradient sum over `reduce_axes` of dz (times `weight`), reshaped to `shape`.

  Biases (`weight` None) and normalisation scales (`weight` = the normalised input).
  """
  def grads(dz):
    prod = dz if weight is None else dz * weight
    summed = tf.reduce_sum(prod, axis=reduce_axes) if reduce_axes else prod
    return rows(summed, list(shape))
  return Term(output, grads)


@dataclasses.dataclass(frozen=True)
class Joint:
  """Per-example gradients of several variables of one layer call, in one go.

  Attributes:
    variables: the variables, in layout order.
    output: index of the recorded output whose gradient dz drives it.
    pieces: dz -> iterable of [B, n_k] float32 pieces whose concatenation along axis 1 is the
      concatenation of the variables' flattened per-example gradients, in order.
  """
  variables: tuple
  output: int
  pieces: Callable


def outer_term(output, pair, kernel_shape, forward, sizes, materialize=None, blocks=None,
               batch=None):
  """Per-example kernel gradient g_i = sum_t a_it b_it^T, reshaped to `kernel_shape`.

  Args:
    output: the recorded output index.
    pair: dz -> (a [B, T, K], b [B, T, O]) float32.
    kernel_shape: the variable's shape (K O elements, in row-major (K, O) order).
    forward: w -> the recorded output's part that is linear in the variable, at value w
      (float32); used for `dots`.
    sizes: static (T, K, O); T may be None (unknown sequence length: always materialise).
    materialize: optional faster dz -> [B, *kernel_shape] replacing the batched matmul.
    blocks: optional dz -> row-major pieces [B, n_k] of the same (see `Term.blocks`).
    batch: the static batch size, if known (for the cost model).
  """
  steps, k, o = sizes
  kernel_shape = list(kernel_shape)

  def grads(dz):
    if materialize is not None:
      return materialize(dz)
    return tf.reshape(outer_products(*pair(dz), steps), [-1] + kernel_shape)

  def gram_norms(dz):
    a, b = pair(dz)
    if steps == 1:
      return tf.reduce_sum(tf.square(a), [1, 2]) * tf.reduce_sum(tf.square(b), [1, 2])
    return tf.reduce_sum(
        tf.matmul(a, a, transpose_b=True) * tf.matmul(b, b, transpose_b=True), [1, 2])

  def batch_sum(dz):
    a, b = pair(dz)
    return tf.reshape(tf.matmul(tf.reshape(a, [-1, k]), tf.reshape(b, [-1, o]), transpose_a=True),
                      kernel_shape)

  return Term(output, grads, gram_norms, forward_dots(forward), batch_sum,
              choice_costs(batch, steps, k, o), blocks)


def outer_products(a, b, steps):
  """Per-example sum_t a_t b_t^T: [B, T, K] x [B, T, O] -> [B, K, O]."""
  if steps == 1:  # Outer products: [B, K, 1] x [B, 1, O].
    return tf.matmul(a[:, 0, :, None], b[:, 0, None, :])
  return tf.matmul(a, b, transpose_a=True)


def dense_like(rec, index, kernel, bias, a_of, dz_rows, sizes, forward, batch):
  """Registers the kernel's outer-product term, the bias term and their joint.

  `a_of()`: the input as [B, T, K]; `dz_rows(dz)`: dz as [B, T, O]; the kernel's row-major layout
  must be (K, O) and the bias' (O,).
  """
  steps = sizes[0]

  def pair(dz):
    return a_of(), dz_rows(dz)

  rec.add(kernel, outer_term(index, pair, kernel.shape, forward, sizes, batch=batch))
  if bias is None:
    return
  bias_term = Term(index, lambda dz: rows(tf.reduce_sum(dz_rows(dz), axis=1), list(bias.shape)))
  rec.add(bias, bias_term)

  def joint(dz):  # The kernel's rows, then the bias row (two pieces: see `Joint`).
    yield flat(outer_products(a_of(), dz_rows(dz), steps))
    yield flat(bias_term.grads(dz))
  rec.add_joint(Joint((kernel, bias), index, joint))


def forward_dots(forward):
  """(dz, g) -> [B] per-example <forward(g), dz> summed over all but the batch axis."""
  def dots(dz, g):
    return tf.reduce_sum(flat(forward(tf.cast(g, tf.float32))) * flat(dz), axis=1)
  return dots
