"""The update step's math: one packed all-reduce, normalise, unscale, check, clip, apply or skip.

Normalisation: replicas hold sums (Σ w_i ∇l_i, Σ w_i l_i, Σ w_i, ...) over their micro-steps; the
update divides the reduced gradient sum by the reduced weight sum, i.e. the gradient of
Σloss/Σcount over the whole update, never a mean of per-micro-batch means.

Everything here runs traced, in REPLICA context (inside `strategy.run`), on every strategy:

    finalize_gradients   the update's only collective: ONE all-reduce of a single packed vector
                         (gradient sums, scalar sums, replica state); every replica ends with the
                         same normalised, clipped gradient and the same `finite` flag.
    apply_or_skip        each replica applies its OWN copy of that gradient to its own variables:
                           merge_call -> tf.cond(finite) -> call_for_each_replica(apply)
                         (the shape of Keras 3's TF LossScaleOptimizer). Nothing but scalars
                         crosses devices, and the same code runs inside TPU's `tpu.replicate`.
                         Strategies that run without merge_call (XLA on GPUs) take the cond in
                         replica context directly.
    ReachedVariables     which variables the loss reaches (trace time): the optimizer gets only
                         those, as in Keras' `fit` (an unreached head is not weight-decayed).

Keras 3 optimizers SUM-all-reduce gradients themselves when applied in replica context
(`_all_reduce_sum_gradients`); `trainer.optimizers.skip_keras_all_reduce` turns that off, so the
packed all-reduce stays the only one.
"""
import dataclasses

from absl import logging
import numpy as np
import tensorflow as tf

from trainer import errors


def pack(tensors) -> tf.Tensor:
  """Concatenates tensors into one flat float32 vector."""
  return tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], axis=0)


def unpack(flat: tf.Tensor, shapes) -> list:
  """Inverse of `pack` for the given static shapes."""
  sizes = [int(np.prod(s)) for s in shapes]
  return [tf.reshape(part, s) for part, s in zip(tf.split(flat, sizes), shapes)]


def all_reduce_packed(tensors) -> list:
  """SUM-reduces float32 tensors across replicas with ONE all-reduce (replica context)."""
  tensors = list(tensors)
  ctx = tf.distribute.get_replica_context()
  if ctx is None or ctx.num_replicas_in_sync == 1:
    return tensors
  reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, pack(tensors))
  return unpack(reduced, [t.shape for t in tensors])


@dataclasses.dataclass
class ReducedUpdate:
  """What every replica knows after the update's all-reduce (replica context, never returned
  from `strategy.run`).

  Attributes:
    grads: normalised (÷ Σweight, ÷ loss scale) and clipped gradients, one per variable.
    unclipped: the same before clipping (`grads` itself without clipping).
    scalars: reduced sums [loss, weight, metrics...].
    grad_norm: global norm before clipping.
    finite: every gradient entry and the loss sum are finite.
    state: replica-local state values averaged over the replicas (see `trainer.replica_state`).
  """
  grads: list
  scalars: tf.Tensor
  grad_norm: tf.Tensor
  finite: tf.Tensor
  state: list
  unclipped: list


def finalize_gradients(grad_sums, scalar_sums, *, loss_scale=None, global_clipnorm=0.0,
                       state_values=()) -> ReducedUpdate:
  """Reduces once, normalises by the weight sum (scalars[1]), unscales, clips (replica context).

  `state_values` ride in the same packed all-reduce and come back as means over the replicas.
  Every replica ends with the same values, so `finite` agrees everywhere without more messages.
  """
  grad_sums, state_values = list(grad_sums), list(state_values)
  reduced = all_reduce_packed(grad_sums + [scalar_sums] + state_values)
  grads, scalars = reduced[:len(grad_sums)], reduced[len(grad_sums)]
  state = reduced[len(grad_sums) + 1:]
  ctx = tf.distribute.get_replica_context()
  replicas = 1 if ctx is None else ctx.num_replicas_in_sync
  if replicas > 1:
    state = [s / float(replicas) for s in state]
  divisor = scalars[1] if loss_scale is None else scalars[1] * loss_scale
  grads = [g / divisor for g in grads]
  norm = tf.linalg.global_norm(grads)
  finite = tf.logical_and(tf.math.is_finite(norm), tf.math.is_finite(scalars[0]))
  unclipped = grads
  if global_clipnorm:
    grads, _ = tf.clip_by_global_norm(grads, global_clipnorm, use_norm=norm)
  return ReducedUpdate(grads=grads, scalars=scalars, grad_norm=norm, finite=finite, state=state,
                       unclipped=unclipped)


class ReachedVariables:
  """Which trainable variables the loss reaches, learned while tracing (Python, trace time).

  The backward pass gives None for a variable the loss does not depend on (an output head the
  loss leaves out, a layer it never calls). Accumulation keeps zeros for it, but the optimizer
  never sees it, as in Keras' `fit`: no weight decay, no slot update. `note` is called with the
  None-ness of every backward pass that feeds the update (a variable is reached if any does);
  `select` filters the update's (gradient, variable) pairs and raises when nothing is left.
  """

  def __init__(self, loss_name: str = "the loss"):
    self.loss_name = loss_name
    self.reached = None  # A tuple of bools, one per trainable variable, once traced.
    self._warned = False

  def note(self, reached) -> None:
    """Records one backward pass's bools, one per variable (e.g. `g is not None` for each
    gradient); trace time."""
    flags = tuple(bool(r) for r in reached)
    if self.reached is None or len(self.reached) != len(flags):  # (Re)traced for a new model.
      self.reached = flags
    else:
      self.reached = tuple(a or b for a, b in zip(self.reached, flags))

  def select(self, grads, variables):
    """(grads, variables) of the reached variables only; all of them before any `note`."""
    grads, variables = list(grads), list(variables)
    if self.reached is None or len(self.reached) != len(variables) or all(self.reached):
      return grads, variables
    if not any(self.reached):
      raise errors.TaskError(f"{self.loss_name} reaches no trainable variable of the model "
                             "(every gradient is None): it must depend on the model's outputs")
    if not self._warned:
      self._warned = True
      missing = [getattr(v, "path", v.name) for v, r in zip(variables, self.reached) if not r]
      logging.warning("%d of %d trainable variables get no gradient from the loss and are left "
                      "unchanged (no weight decay), as in Keras' fit: %s", len(missing),
                      len(variables), ", ".join(missing))
    kept = [i for i, r in enumerate(self.reached) if r]
    return [grads[i] for i in kept], [variables[i] for i in kept]


def apply_or_skip(optimizer, grads, variables, finite) -> tf.Tensor:
  """Applies `grads` on every replica if `finite`, else leaves all optimizer state untouched.

  Replica context (inside `strategy.run`), traced. `grads` are this replica's copy of the reduced
  gradient; `finite` is the same on every replica. A skipped update leaves weights, slots,
  `optimizer.iterations` (hence the schedule) unchanged. Returns `finite`.
  """
  variables = list(variables)

  def apply_here(local_grads):  # Replica context.
    optimizer.apply(list(local_grads), variables)

  if tf.__internal__.distribute.strategy_supports_no_merge_call():
    def applied():
      apply_here(grads)
      return tf.constant(True)
    tf.cond(finite, applied, lambda: tf.constant(False))
    return finite

  def cross_replica(distribution, per_replica_grads, per_replica_finite):
    # Every replica's flag is the same; the first one's decides for all (a scalar).
    decision = distribution.experimental_local_results(per_replica_finite)[0]

    def applied():
      distribution.extended.call_for_each_replica(apply_here, args=(per_replica_grads,))
      return tf.constant(True)
    # The cond must sit in cross-replica context: a replica-context cond cannot contain the
    # merge_call that Keras' apply makes.
    return tf.cond(decision, applied, lambda: tf.constant(False))

  tf.distribute.get_replica_context().merge_call(cross_replica, args=(tuple(grads), finite))
  return finite


def first_replica(strategy, value):
  """The first local replica's component of `value` (cross-replica context): for scalars."""
  return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], value)
