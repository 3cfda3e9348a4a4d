"""The update step's math: one packed all-reduce, normalise, unscale, check, clip, apply.

Normalisation: replicas hold sums (Σ w_i ∇l_i, Σ w_i l_i, Σ w_i, ...) over their micro-steps; the
update divides the reduced gradient sum by the reduced weight sum, i.e. the gradient of
Σloss/Σcount over the whole update, never a mean of per-micro-batch means.

Where each piece runs (all traced inside the Orbit train function):
  * `finalize_gradients`: replica context (inside `strategy.run`); the only communication of an
    update is its one `all_reduce` of a single packed vector.
  * `apply_if_finite`: cross-replica context OUTSIDE `strategy.scope()`. There Keras' optimizer
    does not all-reduce again (it would in replica context) and skips `merge_call` (which cannot
    run under `tf.cond` in replica context), so a non-finite update can be skipped with `tf.cond`
    on every replica: weights, slots, `iterations` and the schedule stay untouched.
"""
import dataclasses

import numpy as np
import tensorflow as tf


def pack(tensors) -> tf.Tensor:
  """Concatenates tensors into one flat float32 vector."""
  return tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], axis=0)


def unpack(flat: tf.Tensor, shapes) -> list:
  """Inverse of `pack` for the given static shapes."""
  sizes = [int(np.prod(s)) for s in shapes]
  return [tf.reshape(part, s) for part, s in zip(tf.split(flat, sizes), shapes)]


def all_reduce_packed(grads, scalars):
  """SUM-reduces gradients and scalars across replicas with ONE all-reduce (replica context)."""
  ctx = tf.distribute.get_replica_context()
  if ctx is None or ctx.num_replicas_in_sync == 1:
    return list(grads), scalars
  shapes = [g.shape for g in grads] + [scalars.shape]
  reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, pack(list(grads) + [scalars]))
  parts = unpack(reduced, shapes)
  return parts[:-1], parts[-1]


@dataclasses.dataclass
class ReducedUpdate:
  """Attributes: grads (normalised, clipped); scalars (reduced sums: loss, weight, metrics...);
  grad_norm (before clipping); finite (bool: every gradient entry and the loss are finite)."""
  grads: list
  scalars: tf.Tensor
  grad_norm: tf.Tensor
  finite: tf.Tensor


def finalize_gradients(grad_sums, scalar_sums, *, loss_scale=None, global_clipnorm=0.0):
  """Reduces once, normalises by the weight sum (scalars[1]), unscales, clips (replica context).

  Every replica ends with the same values, so `finite` agrees everywhere without more messages.
  """
  grads, scalars = all_reduce_packed(grad_sums, scalar_sums)
  divisor = scalars[1] if loss_scale is None else scalars[1] * loss_scale
  grads = [g / divisor for g in grads]
  norm = tf.linalg.global_norm(grads)
  finite = tf.logical_and(tf.math.is_finite(norm), tf.math.is_finite(scalars[0]))
  if global_clipnorm:
    grads, _ = tf.clip_by_global_norm(grads, global_clipnorm, use_norm=norm)
  return ReducedUpdate(grads=grads, scalars=scalars, grad_norm=norm, finite=finite)


def first_replica(strategy, value):
  """The first local replica's component of `value` (cross-replica context)."""
  return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], value)


def apply_if_finite(optimizer, grads, variables, finite) -> tf.Tensor:
  """Applies `grads` if `finite`, else leaves all state untouched; returns `finite`.

  Cross-replica context outside `strategy.scope()`; `grads` are plain (already reduced) tensors.
  """
  def apply():
    optimizer.apply_gradients(zip(grads, variables))
    return tf.constant(True)
  return tf.cond(finite, apply, lambda: tf.constant(False))
