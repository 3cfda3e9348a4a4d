"""Materialised per-example gradients: `per_example_gradients(model, loss_fn, batch)`.

Returns, for every variable, a tensor [B, *var.shape] whose row i is the gradient of example
i's loss alone. Runs eagerly or traced (inside `tf.function`), in cross-replica or replica
context (inside `strategy.run`, where B is the replica's share); it never communicates.

Direct variables (`layers.py`, `conv.py`): one ordinary batch forward is recorded
(`recording.py`), one backward pass gives the gradients of the recorded outputs, and the terms
turn them into exact per-example gradients. General variables: `general.py`.

Semantics and limits:
* Examples must not interact in the forward pass (loss_i depends on example i only).
  BatchNormalization in training mode breaks this and is refused with a ValueError. Losses
  that come out mixed across the examples send every variable to the general path (the
  single-example forward defines each example's gradient; `examples_axis.losses_problem`).
* Random layers: the direct path uses the masks of its one batch forward, so the per-example
  gradients sum exactly to the batch gradient of that forward (same seed state). The general
  path runs its own forward passes (one example each) with their own masks.
* A covered layer whose input is not per example (axis 0 not the batch's example axis: a position
  Embedding over arange(T), a Dense on a learned query) or whose variables are read outside its
  call (tied weights, a regulariser in the loss) takes the general path, decided while recording
  (`examples_axis.py`, `reads.py`); eagerly, a scratch trace of the forward finds the first kind.
  A loss or model call inside an already-traced tf.function raises `Refused` (it would give zeros).
* Loops in the forward pass: the layers of a recurrent layer that is not unrolled take the
  general path; a covered layer called inside any other nested graph (tf.cond, tf.map_fn, a
  tf.function inside the model) raises `Refused` (a one-line ValueError) after the forward.
* Precision: direct formulas compute in float32 (float64 variables get float32 accuracy).
* Memory: the result holds B x (number of parameters) floats. `chunk_size` bounds the
  intermediate memory by processing the batch in chunks inside a `tf.while_loop`; the result is
  identical.
"""
from typing import Any, Callable, Sequence

import tensorflow as tf

from trainer import autograph
from trainer.per_example import general
from trainer.per_example import recording


@autograph.library
def _unchunked(recorder, loss_fn, batch):
  out = {}
  if recorder.direct_indices:
    rec, output_grads, losses = recorder.differentiate(loss_fn, batch)
    out.update(rec.gradients(output_grads, tf.shape(losses)[0]))
  out.update(zip(recorder.general_indices, recorder.general_gradients(loss_fn, batch)))
  return [tf.cast(out[i], v.dtype) for i, v in enumerate(recorder.variables)]


@autograph.library
def _chunked(recorder, loss_fn, batch, chunk_size):
  """Runs `_unchunked` on slices of `chunk_size` examples in a tf.while_loop; concatenates."""
  size = tf.shape(tf.nest.flatten(batch)[0])[0]
  num_chunks = (size + chunk_size - 1) // chunk_size
  arrays = [tf.TensorArray(v.dtype, size=num_chunks, infer_shape=False,
                           element_shape=tf.TensorShape([None]).concatenate(v.shape))
            for v in recorder.variables]

  def body(k, arrays):
    start = k * chunk_size
    chunk = tf.nest.map_structure(lambda t: t[start:start + chunk_size], batch)
    grads = _unchunked(recorder, loss_fn, chunk)
    return k + 1, [a.write(k, g) for a, g in zip(arrays, grads)]

  _, arrays = tf.while_loop(lambda k, _: k < num_chunks, body, (tf.constant(0), arrays))
  return [a.concat() for a in arrays]


def per_example_gradients(model: Any, loss_fn: Callable[[Any, Any], tf.Tensor], batch: Any, *,
                          variables: Sequence[Any] | None = None, chunk_size: int = 0,
                          general_path: str = "vectorized_map") -> list[tf.Tensor]:
  """Per-example gradients of `loss_fn(model, batch)` ([B] losses) w.r.t. `variables`.

  Eager or traced; replica or cross-replica context (no communication).

  Args:
    model: a Keras 3 model/layer (its covered layers use the direct formulas), or any object
      exposing `trainable_variables` (general path only).
    loss_fn: `loss_fn(model, batch) -> [B]` per-example losses; it chooses `training=`.
    batch: a tensor or nest of tensors, all with leading dimension B.
    variables: defaults to `model.trainable_variables`.
    chunk_size: 0 processes the batch at once; k > 0 processes k examples at a time in a
      tf.while_loop (same result, less intermediate memory).
    general_path: `vectorized_map` | `loop` | `error`, for variables without a direct formula.

  Returns:
    One tensor `[B, *var.shape]` per variable, in the order of `variables`.
  """
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 0:
    raise ValueError(f"chunk_size must be an int >= 0 (0: no chunking); got {chunk_size!r}.")
  recorder = recording.Recorder(model, variables, general_path=general_path)
  recorder.scout(loss_fn, batch)
  loss_fn = autograph.like_caller(loss_fn)
  static_size = tf.nest.flatten(batch)[0].shape[0]
  if chunk_size == 0 or (static_size is not None and static_size <= chunk_size):
    return _unchunked(recorder, loss_fn, batch)
  return _chunked(recorder, loss_fn, batch, chunk_size)
