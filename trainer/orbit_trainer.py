"""The Orbit trainer: one `train_step` is ONE optimizer update made of k micro-steps.

    controller.train(steps)                       # orbit.Controller, eager
      trainer.train(steps_per_loop)               # orbit.StandardTrainer
        train_loop_begin()                        # eager: reset loop sums, start the clock
        tf.while_loop over steps_per_loop:        # traced (tf.function)
          train_step(iterator):                   # cross-replica context
            every per_example.every_steps updates: statistics of the first micro-batch
            k == 1: reduced = run(reduce_step, next(iterator))
            k >  1: k x run(micro_step, next(iterator))  # tf.range loop, no communication
                    reduced = run(reduce_buffers)                           # ONE all-reduce
            apply_if_finite(reduced)              # applies, or skips on every replica
            counters (global step, micro-batches, skips, loss scale)
        train_loop_end()                          # eager: metrics, one log line

The micro-step loop is a `tf.range` loop (a tf.while_loop), which frees each micro-step's
activations before the next one; a Python loop would unroll k copies into the graph.
"""
import time

from absl import logging
import orbit
import tensorflow as tf

from trainer import accumulation
from trainer import per_example_summaries
from trainer import update
from trainer import validation

_MIRRORED_SCALAR = dict(trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def _counter(name, dtype=tf.int64, value=0):
  return tf.Variable(tf.constant(value, dtype), name=name, **_MIRRORED_SCALAR)


def has_trainable_batchnorm(model) -> bool:
  import keras  # pylint: disable=g-import-not-at-top
  return any(isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
             for layer in model._flatten_layers())  # pylint: disable=protected-access


class Trainer(orbit.StandardTrainer):
  """Exact gradient accumulation over SyncOnRead buffers; see the module docstring."""

  def __init__(self, *, config, strategy, task, model, optimizer, train_dataset):
    """Builds buffers, counters and the optimizer's slots; eager, enters `strategy.scope()`."""
    self.config, self.strategy, self.task = config, strategy, task
    self.model, self.optimizer = model, optimizer
    self.accumulation_steps = int(config.accumulation.steps)
    self.metric_names = ("loss", "weight") + tuple(task.metric_names)
    variables = model.trainable_variables
    if self.accumulation_steps > 1 and has_trainable_batchnorm(model) and (
        config.accumulation.batchnorm == "error"):
      raise validation.ConfigError(
          "`accumulation.steps`>1 with trainable BatchNormalization: set "
          "`accumulation.batchnorm`=per_micro_batch (statistics per micro-batch, documented in "
          "docs/accumulation.md) or use a model without BatchNorm")
    with strategy.scope():
      optimizer.build(variables)
      self.global_step = orbit.utils.create_global_step()
      self.micro_batches_seen = _counter("micro_batches_seen")
      self.skipped_updates = _counter("skipped_updates")
      self.consecutive_skips = _counter("consecutive_skips")
      self.loop_sums = tf.Variable(tf.zeros([len(self.metric_names)]), name="loop_sums",
                                   **_MIRRORED_SCALAR)
      self.last_grad_norm = _counter("last_grad_norm", tf.float32, 0.0)
      self.loss_scale = None
      if config.mixed_precision == "mixed_float16":
        self.loss_scale = _counter("loss_scale", tf.float32, float(config.loss_scale.initial))
        self.good_steps = _counter("loss_scale_good_steps")
      self.buffers = None
      if self.accumulation_steps > 1:
        self.buffers = accumulation.GradientBuffers(variables, len(self.metric_names))
    options = orbit.StandardTrainerOptions(use_tf_while_loop=True, use_tf_function=True)
    super().__init__(train_dataset, options=options)
    self._loop_start = None

  def checkpoint_items(self) -> dict:
    """What a checkpoint holds: weights, model, optimizer, counters (incl. data position), loss scale.

    `weights` stores each model variable under the readable key
    `weights/<index in model.weights>-<variable name>/.ATTRIBUTES/VARIABLE_VALUE`, e.g.
    `weights/000-kernel/...` (tf.train.load_checkpoint). Keras layer names come from a
    process-wide counter (`dense`, `dense_1`, ...), so they are left out of the keys.
    """
    weights = {f"{i:03d}-{v.name}": v.value for i, v in enumerate(self.model.weights)}
    items = dict(weights=weights, model=self.model, optimizer=self.optimizer,
                 global_step=self.global_step,
                 micro_batches_seen=self.micro_batches_seen, skipped_updates=self.skipped_updates,
                 consecutive_skips=self.consecutive_skips)
    if self.loss_scale is not None:
      items.update(loss_scale=self.loss_scale, loss_scale_good_steps=self.good_steps)
    return items

  # --- Replica context (traced, inside strategy.run).
  def local_sums(self, batch):
    """This replica's gradient of Σ w·loss (scaled if fp16) and its scalar sums; no communication."""
    variables = self.model.trainable_variables
    with tf.GradientTape() as tape:
      out = self.task.per_example_loss(self.model, batch, training=True)
      weight_sum = tf.reduce_sum(out.weight)
      loss_sum = tf.reduce_sum(out.loss * out.weight)
      objective = loss_sum
      if self.model.losses:  # Regularisers: weighted so that the update sees them exactly once.
        objective += tf.add_n([tf.cast(l, tf.float32) for l in self.model.losses]) * weight_sum
      if self.loss_scale is not None:
        objective *= self.loss_scale
    grads = tape.gradient(objective, variables)
    grads = [accumulation.dense_float32(g, v) for g, v in zip(grads, variables)]
    metrics = [tf.reduce_sum(out.metrics[n] * out.weight) for n in self.task.metric_names]
    return grads, tf.stack([loss_sum, weight_sum] + metrics)

  def micro_step(self, batch):
    """Adds this replica's sums into its SyncOnRead buffers (replica context, local only)."""
    self.buffers.add(*self.local_sums(batch))

  def _finalize(self, grads, scalars):
    """The update's one all-reduce, normalisation and clipping (replica context)."""
    return update.finalize_gradients(
        grads, scalars, loss_scale=self.loss_scale,
        global_clipnorm=float(self.config.optimizer.global_clipnorm))

  def reduce_step(self, batch):
    """k == 1: local sums of one batch, then the update's single all-reduce (replica context)."""
    return self._finalize(*self.local_sums(batch))

  def reduce_buffers(self):
    """k > 1: this replica's buffers, zeroed, then the update's single all-reduce."""
    return self._finalize(*self.buffers.take())

  # --- Cross-replica context (traced).
  def train_step(self, iterator):
    """One optimizer update of k micro-steps; see the module docstring."""
    first_batch = next(iterator)
    self._maybe_write_statistics(first_batch)
    if self.accumulation_steps == 1:
      reduced = self.strategy.run(self.reduce_step, args=(first_batch,))
    else:
      self.strategy.run(self.micro_step, args=(first_batch,))
      for _ in tf.range(self.accumulation_steps - 1):
        self.strategy.run(self.micro_step, args=(next(iterator),))
      reduced = self.strategy.run(self.reduce_buffers)
    reduced = update.first_replica(self.strategy, reduced)
    applied = update.apply_if_finite(self.optimizer, reduced.grads,
                                     self.model.trainable_variables, reduced.finite)
    self._count(applied, reduced)

  def _maybe_write_statistics(self, batch):
    """Per-example statistics of `batch` every n updates (cross-replica context, traced)."""
    every = int(self.config.per_example.every_steps)
    if not every:
      return
    tf.cond(tf.equal(self.global_step % every, 0),
            lambda: per_example_summaries.write_statistics(
                self.strategy, self.task, self.model, batch, self.global_step,
                int(self.config.per_example.chunk_size)),
            lambda: tf.constant(False))

  def _count(self, applied, reduced):
    """Advances the counters and the loss scale after an update (cross-replica, traced)."""
    self.global_step.assign_add(1)
    self.micro_batches_seen.assign_add(self.accumulation_steps)
    skipped = 1 - tf.cast(applied, tf.int64)
    self.skipped_updates.assign_add(skipped)
    self.consecutive_skips.assign((self.consecutive_skips + 1) * skipped)
    self.loop_sums.assign_add(tf.where(applied, reduced.scalars, tf.zeros_like(reduced.scalars)))
    self.last_grad_norm.assign(reduced.grad_norm)
    if self.loss_scale is not None:  # Dynamic loss scaling: halve on overflow, double when calm.
      good = (self.good_steps + 1) * (1 - skipped)
      grow = good >= int(self.config.loss_scale.growth_interval)
      self.loss_scale.assign(tf.where(
          applied, tf.where(grow, self.loss_scale * 2.0, self.loss_scale),
          tf.maximum(self.loss_scale / 2.0, 1.0)))
      self.good_steps.assign(tf.where(grow, tf.zeros_like(good), good))

  # --- Eager, host.
  def train_loop_begin(self):
    with self.strategy.scope():
      self.loop_sums.assign(tf.zeros_like(self.loop_sums))
    self._loop_start = (time.perf_counter(), int(self.global_step.numpy()))

  def train_loop_end(self):
    """Loop metrics (TensorBoard scalars via the Controller) and one fixed-format log line."""
    start_time, start_step = self._loop_start
    elapsed = max(time.perf_counter() - start_time, 1e-9)
    step = int(self.global_step.numpy())
    sums = self.loop_sums.numpy()
    weight = max(float(sums[1]), 1e-12)
    steps_per_s = (step - start_step) / elapsed
    examples_per_s = steps_per_s * self.accumulation_steps * self.config.batch_size
    eta = max(self.config.train_steps - step, 0) / max(steps_per_s, 1e-9)
    output = {"loss": sums[0] / weight, "learning_rate": float(self.current_learning_rate()),
              "examples_per_second": examples_per_s, "grad_norm": float(self.last_grad_norm.numpy()),
              "skipped_updates": int(self.skipped_updates.numpy()),
              "micro_steps": int(self.micro_batches_seen.numpy()),
              "examples_seen": int(self.micro_batches_seen.numpy()) * self.config.batch_size}
    for i, name in enumerate(self.task.metric_names):
      output[name] = sums[2 + i] / weight
    if self.loss_scale is not None:
      output["loss_scale"] = float(self.loss_scale.numpy())
    metric = self.task.metric_names[0]
    logging.info("train step %d/%d | loss %.4f | %s %.4f | %.1f steps/s | %.0f examples/s | "
                 "ETA %ds | lr %.3g | skipped %d", step, self.config.train_steps, output["loss"],
                 metric, output[metric], steps_per_s, examples_per_s, eta,
                 output["learning_rate"], output["skipped_updates"])
    limit = int(self.config.max_consecutive_skips)
    if limit and int(self.consecutive_skips.numpy()) >= limit:
      raise FloatingPointError(
          f"{int(self.consecutive_skips.numpy())} consecutive updates had non-finite loss or "
          f"gradients (`max_consecutive_skips`={limit}); stopping instead of training on garbage")
    return output

  def current_learning_rate(self) -> float:
    """The schedule's value at the current `optimizer.iterations` (eager)."""
    return float(tf.convert_to_tensor(self.optimizer.learning_rate))
