"""The Orbit evaluator: weighted loss and metric sums over the test split, in SyncOnRead sums.

    evaluator.evaluate(num_steps)       # orbit.StandardEvaluator
      eval_begin()                      # eager: zero the sums on every replica
      eval_step(iterator) x num_steps   # traced; replica context adds local Σ w·loss, Σ w, the
                                        # count of examples of nonzero weight, Σ w·metric
      eval_end()                        # eager: one cross-replica read (SUM), then ratios
Padding examples of the last batch carry weight 0, so the whole split counts exactly once. A
BatchLossTask's `batch_loss` is over the whole global batch (one all_gather of the replicas'
representations), so its evaluation does not depend on the number of replicas of a machine.
A tf.data source without a known length is evaluated until it is exhausted (`num_steps=-1`).
An evaluation that counted no example (empty source, all weights 0) is a `DataError`; one
whose loss or a metric is NaN or infinite is a WARNING. During a single-worker training run, a
SIGTERM or SIGINT stops an evaluation at once when its update is checkpointed (`evaluate`).
"""
import math

from absl import logging
import orbit
import tensorflow as tf

from trainer import autograph
from trainer import base_task
from trainer import errors
from trainer import shutdown


class Evaluator(orbit.StandardEvaluator):
  """Evaluates `task.per_example_loss(..., training=False)` over an eval dataset."""

  def __init__(self, *, strategy, task, model, eval_dataset):
    self.strategy, self.task, self.model = strategy, task, model
    with strategy.scope():
      self.sums = tf.Variable(
          tf.zeros([3 + len(task.metric_names)]), trainable=False, name="eval_sums",
          synchronization=tf.VariableSynchronization.ON_READ,
          aggregation=tf.VariableAggregation.SUM)
    super().__init__(eval_dataset, options=orbit.StandardEvaluatorOptions(use_tf_function=True))
    # The update being evaluated if its checkpoint is on disk, else None (set by the runner for
    # a single-worker training run): a signal then stops the evaluation at once.
    self.checkpointed_update = lambda: None

  def evaluate(self, num_steps):
    """Orbit's evaluation (eager; a Python loop over traced steps, so a signal is handled
    between two). With nothing unsaved a signal stops it at once: the rerun evaluates the
    update first, as `evaluated.json` does not name it (`trainer.evaluated`)."""
    update = self.checkpointed_update()
    if update is None:  # Signals noted; the watcher stops after the evaluation (and saves).
      return super().evaluate(num_steps)
    describe = lambda name: (f"stopped by {name} during the evaluation of update {update}, "
                             "whose checkpoint is written; rerun the same command: it evaluates "
                             f"update {update} first")
    with shutdown.at_once(describe):
      return super().evaluate(num_steps)

  def eval_begin(self):
    with self.strategy.scope():
      self.sums.assign(tf.zeros_like(self.sums))

  @autograph.library
  def eval_step(self, iterator):
    """Cross-replica context (traced); the replica function adds local sums (a BatchLossTask's
    replicas first gather their representations: one all_gather)."""
    gather = None  # A batch-level loss is over the whole global batch, as on one device.
    if isinstance(self.task, base_task.BatchLossTask) and self.strategy.num_replicas_in_sync > 1:
      # Every replica's rows in replica order, which is stream order; each field keeps its
      # dtype and shape, and a replica with no rows (a MultiWorker tail) adds none. Each field
      # is first copied onto the replica's device: a field taken straight from the batch (a
      # label) has no device under MultiWorkerMirrored with one device per worker, and TF's
      # all_gather takes a tensor's device as its destination ("destinations can not be
      # empty", found 2026-12-08 by the two-process test).
      gather = lambda fields: tf.distribute.get_replica_context().all_gather(
          tf.nest.map_structure(tf.identity, fields), axis=0)

    def step(batch):
      loss, weight, metrics = base_task.weighted_outputs(self.task, self.model, batch,
                                                         training=False, gather=gather)
      # Padding rows (weight 0) may hold anything; they must not poison the sums. Other weights,
      # negative ones too, count as in training: sum(w * loss) / sum(w).
      counted = tf.not_equal(weight, 0.0)
      weighted = lambda v: tf.reduce_sum(tf.where(counted, v * weight, 0.0))
      count = tf.reduce_sum(tf.cast(counted, tf.float32))
      self.sums.assign_add(tf.stack(
          [weighted(loss), tf.reduce_sum(weight), count] + [weighted(m) for m in metrics]))
    self.strategy.run(step, args=(autograph.next_batch(iterator),))

  def eval_end(self):
    with self.strategy.scope():
      sums = self.sums.read_value().numpy()
    if sums[1] == 0:  # A loss of 0 would read as perfect; NaN as diverged.
      raise errors.DataError(
          "the evaluation data counted no example (total weight 0): the eval source is empty "
          "(e.g. a filter drops every example), every weight is 0, or the weights cancel out")
    weight = float(sums[1])
    # `examples` counts the rows that count (nonzero weight); `weight` is what divides.
    output = {"loss": sums[0] / weight, "examples": float(sums[2]), "weight": weight}
    for i, name in enumerate(self.task.metric_names):
      output[name] = sums[3 + i] / weight
    broken = [f"{name} {value}" for name, value in output.items() if not math.isfinite(value)]
    if broken:  # result.json holds them as null: say why.
      logging.warning("the evaluation is not finite (%s): the model's outputs overflowed or "
                      "diverged, or an example's loss is NaN or infinite; result.json writes "
                      "these as null", ", ".join(broken))
    return output
