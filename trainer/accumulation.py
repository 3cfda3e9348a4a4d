"""Gradient accumulation buffers: SyncOnRead (ON_READ, SUM) float32 variables.

One buffer per trainable variable plus one vector of scalar sums (loss, weight, metrics). During a
micro-step each replica adds its LOCAL gradient sum into its own component: `assign_add` on an
ON_READ variable in replica context touches only the local copy, so micro-steps never
communicate. The update step reads each replica's local sums back (`take`) and reduces them once,
packed (`trainer.update.all_reduce_packed`). The buffers are zero at every update boundary, which
is the only place a checkpoint is written, so they are never checkpointed.

    with strategy.scope():                       # eager
      buffers = GradientBuffers(model.trainable_variables, num_scalars=3)
    # traced, replica context, k times:          buffers.add(local_grads, local_scalars)
    # traced, replica context, once per update:  grad_sums, scalar_sums = buffers.take()
"""
import tensorflow as tf

_SYNC = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
             aggregation=tf.VariableAggregation.SUM)


def dense_float32(gradient, variable):
  """A dense float32 gradient (IndexedSlices densified, None as zeros) of the variable's static
  shape. A model fed a [B, None] tensor (a boolean mask, a summed VarLen field) traces its first
  kernel's gradient as [None, n]: the update's packed all-reduce, which unpacks by static
  shapes, failed with a TypeError traceback under Mirrored with k = 1 (a probe, 2026-12-07)."""
  if gradient is None:
    return tf.zeros(variable.shape, tf.float32)
  dense = tf.cast(tf.convert_to_tensor(gradient), tf.float32)
  dense.set_shape(variable.shape)  # A fact, not a check: no op is added.
  return dense


def zeros_for_none(gradients, tensors) -> list:
  """`gradients` of `tensors` with None replaced by zeros of the tensor's shape and dtype."""
  return [tf.zeros_like(t) if g is None else g for g, t in zip(gradients, tensors)]


class GradientBuffers:
  """Per-replica float32 sums of gradients and of scalars across the micro-steps of one update."""

  def __init__(self, variables, num_scalars: int):
    """Creates the buffers; call eagerly under `strategy.scope()` (else they are plain variables)."""
    if not tf.executing_eagerly():
      raise RuntimeError("GradientBuffers must be created eagerly under strategy.scope(), "
                         "not inside a tf.function")
    self.grads = [tf.Variable(tf.zeros(v.shape, tf.float32), name=f"accum_{i}", **_SYNC)
                  for i, v in enumerate(variables)]
    self.scalars = tf.Variable(tf.zeros([num_scalars], tf.float32), name="accum_scalars", **_SYNC)
    self._variables = list(variables)

  def add(self, grads, scalars) -> None:
    """Adds this replica's local sums; traced, replica context, no communication."""
    for buffer, grad, var in zip(self.grads, grads, self._variables):
      buffer.assign_add(dense_float32(grad, var))
    self.scalars.assign_add(scalars)

  def take(self):
    """Returns this replica's local sums and zeroes them; traced, replica context, local only."""
    grads = [tf.identity(b.read_value()) for b in self.grads]
    scalars = tf.identity(self.scalars.read_value())
    with tf.control_dependencies(grads + [scalars]):
      for buffer in self.grads:
        buffer.assign(tf.zeros_like(buffer))
      self.scalars.assign(tf.zeros_like(self.scalars))
    return grads, scalars

  def local_values(self, strategy):
    """Each replica's own sums, as numpy (eager, cross-replica): for tests and debugging."""
    return ([[t.numpy() for t in strategy.experimental_local_results(b)] for b in self.grads],
            [t.numpy() for t in strategy.experimental_local_results(self.scalars)])
