"""The Orbit trainer: one `train_step` is ONE optimizer update made of k micro-steps.

    controller.train(steps)                       # orbit.Controller, eager
      trainer.train(steps_per_loop)               # orbit.StandardTrainer
        train_loop_begin()                        # eager: reset loop sums, start the clock
        tf.while_loop over steps_per_loop:        # traced (tf.function)
          train_step(iterator):                   # cross-replica context
            k-1 x run(micro_step, next(iterator))  # tf.while_loop; replica: buffers += local sums
            run(update_step, next(iterator))       # replica context, every replica:
              local sums of the last micro-batch + buffers (zeroed)
              ONE packed all-reduce: gradients, loss/weight/metric sums, BatchNorm statistics
              normalise, clip once, mean statistics written back locally
              apply_or_skip: merge_call -> tf.cond(finite) -> each replica applies its own copy
            per-example statistics summaries, every per_example.every_steps updates
            counters (global step, micro-batches, skips, loss scale)   # cross-replica, scalars
        train_loop_end()                          # eager: metrics, one log line

The micro-step loop is a tf.while_loop, which frees each micro-step's activations before the
next one; a Python loop would unroll k copies into the graph. The framework's code is traced
without AutoGraph, the task's with it (`trainer.autograph`). Every
function handed to `strategy.run` returns only tensors, so the same code runs inside TPU's
`tpu.replicate`. With `config.xla` on, the replica functions are compiled with XLA: always the
local forward/backward and buffer adds; the whole update where XLA has the collective (one
replica, or GPUs only); see docs/design.md.
"""
import time

from absl import logging
import orbit
import tensorflow as tf

from trainer import accumulation
from trainer import autograph
from trainer import base_task
from trainer import gradcache
from trainer import optimizers
from trainer import replica_state
from trainer import skip_window
from trainer import update
from trainer import update_statistics
from trainer import validation
from trainer import xla

_MIRRORED_SCALAR = dict(trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def _counter(name, dtype=tf.int64, value=0):
  return tf.Variable(tf.constant(value, dtype), name=name, **_MIRRORED_SCALAR)


def has_trainable_batchnorm(model) -> bool:
  import keras  # pylint: disable=g-import-not-at-top
  return any(isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
             for layer in model._flatten_layers())  # pylint: disable=protected-access


def _gradcache_for(config, task, model, strategy):
  """The GradCache of `accumulation.mode=gradcache`, or one line saying why it cannot be."""
  if not isinstance(task, base_task.BatchLossTask):
    raise validation.ConfigError(
        f"`accumulation.mode`=gradcache needs a task with a batch-level loss "
        f"(base_task.BatchLossTask: represent + batch_loss); {type(task).__name__} has "
        "per-example losses, for which `sum` is already exact")
  if has_trainable_batchnorm(model):
    raise validation.ConfigError(
        "`accumulation.mode`=gradcache with trainable BatchNormalization: batch statistics "
        "differ between the passes and mix examples; freeze it or use LayerNormalization")
  return gradcache.GradCache(task, model, micro_steps=int(config.accumulation.steps),
                             num_replicas=strategy.num_replicas_in_sync, seed=int(config.seed))


# What the skip-limit errors name as the usual causes of a non-finite update.
_SKIP_CAUSES = ("a diverging loss, a NaN or Inf in the data, or an update whose weights sum to "
                "0: 0/0")


class Trainer(orbit.StandardTrainer):
  """Exact gradient accumulation over SyncOnRead buffers; see the module docstring."""

  def __init__(self, *, config, strategy, task, model, optimizer, train_dataset):
    """Builds buffers, counters and the optimizer's slots; eager, enters `strategy.scope()`."""
    self.config, self.strategy, self.task = config, strategy, task
    self.model, self.optimizer = model, optimizer
    self.accumulation_steps = int(config.accumulation.steps)
    self._examples_per_update = float(config.batch_size * self.accumulation_steps)
    self.metric_names = ("loss", "weight") + tuple(task.metric_names)
    variables = model.trainable_variables
    self.gradcache = None
    if config.accumulation.mode == "gradcache":
      self.gradcache = _gradcache_for(config, task, model, strategy)
    if self.accumulation_steps > 1 and has_trainable_batchnorm(model) and (
        config.accumulation.batchnorm == "error"):
      raise validation.ConfigError(
          "`accumulation.steps`>1 with trainable BatchNormalization: set "
          "`accumulation.batchnorm`=per_micro_batch (statistics per micro-batch, documented in "
          "docs/accumulation.md) or use a model without BatchNorm")
    with strategy.scope():
      optimizer.build(variables)
      optimizers.skip_keras_all_reduce(optimizer)
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
      self.statistics = update_statistics.UpdateStatistics(
          config, task, model, num_replicas=strategy.num_replicas_in_sync,
          accumulation_steps=self.accumulation_steps)
      self.buffers = None
      if self.accumulation_steps > 1 or self.gradcache is not None:
        extra = self.statistics.num_sums if self.statistics.enabled else 0
        self.buffers = accumulation.GradientBuffers(variables, len(self.metric_names) + extra)
    self._state = replica_state.WriteRecorder(model)
    self._warned_state_writes = False
    self._sync_state = config.replica_state == "mean"
    self.xla = xla.plan(config, strategy, model)
    self._micro_step_fn = self.micro_step
    if self.xla.micro_step:
      compiled_micro_step = xla.PerReplicaCompiled(self.micro_step)
      self._micro_step_fn = lambda batch: compiled_micro_step(batch)  # A plain replica function.
    update_step = self.update_step if self.gradcache is None else self.gradcache_update_step
    self._update_step_fn = (tf.function(update_step, jit_compile=True, autograph=False)
                            if self.xla.update_step else update_step)
    # With statistics on every update (and no regularisation losses, which act on the weights
    # directly), the recorded layers' gradients come from the per-example terms' sums.
    self._gradients_from_statistics = (self.statistics.enabled and self.statistics.every == 1
                                       and not model.losses)
    loss_name = type(task).__name__ + (".batch_loss" if self.gradcache else ".per_example_loss")
    self.reached = update.ReachedVariables(loss_name)  # Filled while tracing.
    self._built_variable_ids = {id(v) for v in variables}
    self.gradients_from_statistics_traced = False  # Set while tracing, for tests.
    # The update step needs the statistics' recorded tensors after its all-reduce: with
    # statistics on, its local part is not a separate (compiled) function.
    self._local_sums_compiled = None
    if self.xla.local_sums and not self.statistics.enabled:
      self._local_sums_compiled = xla.PerReplicaCompiled(lambda batch: self.local_sums(batch)[:2])
    options = orbit.StandardTrainerOptions(use_tf_while_loop=True, use_tf_function=True)
    super().__init__(train_dataset, options=options)
    self._loop_start = None
    self.skip_window = skip_window.SkipWindow(config.skip_window, config.max_skipped_fraction,
                                              _SKIP_CAUSES)
    self.restored_checkpoint = None  # Set by run.build.

  def checkpoint_items(self) -> dict:
    """What a checkpoint holds: weights, random-layer states, model, optimizer, counters (incl.
    the data position), loss scale.

    `weights` stores each model variable under the readable key
    `weights/<index in model.weights>-<variable name>/.ATTRIBUTES/VARIABLE_VALUE`, e.g.
    `weights/000-kernel/...` (tf.train.load_checkpoint). Keras layer names come from a
    process-wide counter (`dense`, `dense_1`, ...), so they are left out of the keys.
    """
    weights = {f"{i:03d}-{v.name}": v.value for i, v in enumerate(self.model.weights)}
    # The random layers' generator states (not in model.weights): resumed dropout masks are
    # the ones an uninterrupted run draws.
    rng = {f"{i:03d}": s.value for i, s in enumerate(replica_state.seed_states(self.model))}
    rng.update({f"task-{i:03d}": s.value for i, s in enumerate(
        replica_state.task_seed_states(self.task, self.model))})  # (Generators the task keeps.)
    items = dict(weights=weights, rng=rng, model=self.model, optimizer=self.optimizer,
                 global_step=self.global_step,
                 micro_batches_seen=self.micro_batches_seen, skipped_updates=self.skipped_updates,
                 consecutive_skips=self.consecutive_skips)
    if self.loss_scale is not None:
      items.update(loss_scale=self.loss_scale, loss_scale_good_steps=self.good_steps)
    return items

  # --- Replica context (traced, inside strategy.run).
  def local_sums(self, batch):
    """This replica's gradient of Σ w·loss (scaled if fp16) and its scalar sums; no communication.

    Returns (grads, scalars, statistics context or None). With per-example statistics on, the
    forward runs recorded, the one backward also yields the recorded outputs' gradients, and
    `scalars` ends with this micro-batch's statistics sums (zeros on other updates).
    """
    variables = self.model.trainable_variables
    with tf.GradientTape() as tape:
      with self._state.watching(), self.statistics.recording(tape, batch) as recording:
        loss, weight, metrics = base_task.weighted_outputs(self.task, self.model, batch,
                                                           training=True)
        if recording is not None:  # Losses that mix the examples: no direct formula holds.
          recording.check_losses(loss)
      weight_sum = tf.reduce_sum(weight)
      loss_sum = tf.reduce_sum(loss * weight)
      objective = loss_sum
      # Regularisers, weighted so that the update sees them exactly once. Read after the
      # recording: Keras reads the weights here, for the batch objective, not for any example's
      # loss, so they are no read outside a layer's call that would demote the layer.
      if self.model.losses:
        objective += tf.add_n([tf.cast(l, tf.float32) for l in self.model.losses]) * weight_sum
      scale = self._gradient_scale()
      if scale is not None:
        objective *= scale
    base_task.check_no_new_variables(self.task, self.model, self._built_variable_ids)
    if recording is None:
      grads = tape.gradient(objective, variables)
      self.reached.note(g is not None for g in grads)
    elif self._gradients_from_statistics:
      grads, output_grads = self.statistics.recorded_gradients(tape, objective, recording,
                                                               self.reached)
      self.gradients_from_statistics_traced = True
    else:  # ONE backward pass for the update and the per-example statistics.
      grads, output_grads = tape.gradient(objective, (variables, recording.outputs))
      self.reached.note(g is not None for g in grads)
      output_grads = accumulation.zeros_for_none(output_grads, recording.outputs)
    grads = [accumulation.dense_float32(g, v) for g, v in zip(grads, variables)]
    metric_sums = [tf.reduce_sum(m * weight) for m in metrics]
    scalars = tf.stack([loss_sum, weight_sum] + metric_sums)
    if recording is None:
      return grads, scalars, None
    context = dict(active=self.statistics.active(self.global_step), rec=recording,
                   output_grads=output_grads, loss_scale=scale, batch=batch, losses=loss,
                   weights=weight)
    sums, context["terms"] = self.statistics.local_sums(
        context["active"], recording, output_grads, scale, batch, loss, weight,
        terms_sum_is_gradient=self._gradients_from_statistics)
    if self._gradients_from_statistics:  # Σ_i g_i of the terms IS the gradient.
      batch_sums = context["terms"].batch_sums
      for i in self.statistics.recorder.direct_indices:
        grads[i] = batch_sums[i] if scale is None else batch_sums[i] * scale
    return grads, tf.concat([scalars, sums], axis=0), context

  def micro_step(self, batch):
    """Adds this replica's sums into its SyncOnRead buffers (replica context, local only)."""
    self.buffers.add(*self.local_sums(batch)[:2])

  def update_step(self, batch):
    """The update: last micro-batch + buffers, one all-reduce, apply or skip (replica context).

    Returns (reduced scalar sums, gradient norm, applied) and, with per-example statistics on,
    (statistics scalars, gathered [B, 3] norms, cosines, weight-not-0 flags): tensors only,
    identical on every replica.
    """
    if self._local_sums_compiled is not None:
      (grads, scalars), context = self._local_sums_compiled(batch), None
    else:
      grads, scalars, context = self.local_sums(batch)
    if self.buffers is not None:
      held_grads, held_scalars = self.buffers.take()
      grads = [h + g for h, g in zip(held_grads, grads)]
      scalars = held_scalars + scalars
    return self._reduce_and_apply(grads, scalars, context, self._gradient_scale())

  def gradcache_update_step(self, *batches):
    """`accumulation.mode=gradcache`: both passes over the k micro-batches, then the update.

    Replica context; `batches` are this replica's k micro-batches (`trainer.gradcache`).
    """
    scalars = self.gradcache.accumulate(batches, self.buffers, self.global_step,
                                        self.loss_scale, reached=self.reached)
    base_task.check_no_new_variables(self.task, self.model, self._built_variable_ids)
    grads, held_scalars = self.buffers.take()
    return self._reduce_and_apply(grads, held_scalars + scalars, None, self.loss_scale)

  def _gradient_scale(self):
    """The factor on Σ w·loss under mixed_float16, else None (replica context, traced).

    The loss scale divided by the examples of one update (`batch_size` x k, all replicas): each
    example's float16 gradient is then as large as under Keras, which scales the mean loss, and
    the same whatever k, the micro-batch size or the number of replicas. (Scaling the sum made
    it B times larger: more overflows, skipped updates and a loss scale that depended on B, k
    and the replicas.) `accumulation.mode=gradcache` scales its own mean loss by the loss scale.
    """
    if self.loss_scale is None:
      return None
    return self.loss_scale / self._examples_per_update

  def _reduce_and_apply(self, grads, scalars, context, scale):
    """The update's one all-reduce, normalisation, clipping, state, statistics, apply or skip.

    `scale`: the factor the gradient sums carry (None: none), divided out after the all-reduce.
    """
    state = self._state.variables if self._sync_state else []
    reduced = update.finalize_gradients(
        grads, scalars, loss_scale=scale,
        global_clipnorm=float(self.config.optimizer.global_clipnorm),
        state_values=replica_state.local_values(state))
    replica_state.assign_means(state, reduced.state)
    outputs = (reduced.scalars[:len(self.metric_names)], reduced.grad_norm)
    if context is not None:
      data_grads, data_norm = self.statistics.data_gradient(reduced)
      statistics = self.statistics.statistics(reduced.scalars[len(self.metric_names):],
                                              data_norm, reduced.scalars[1])
      norms_and_cosines = self.statistics.norms_and_cosines(grads=data_grads, **context)
      gathered = tf.distribute.get_replica_context().all_gather(norms_and_cosines, axis=0)
    applied = update.apply_or_skip(
        self.optimizer, *self.reached.select(reduced.grads, self.model.trainable_variables),
        reduced.finite)
    optimizers.check_keras_all_reduce_skipped(self.optimizer)  # At trace time.
    if context is None:
      return outputs + (applied,)
    return outputs + (applied, statistics, gathered)

  # --- Cross-replica context (traced).
  @autograph.library
  def train_step(self, iterator):
    """One optimizer update of k micro-steps; see the module docstring."""
    if self.gradcache is not None:  # Both passes need the k micro-batches: read them first.
      batches = tuple(autograph.next_batch(iterator) for _ in range(self.accumulation_steps))
      outputs = self.strategy.run(self._update_step_fn, args=batches)
      self._count(*update.first_replica(self.strategy, outputs))
      return
    if self.accumulation_steps > 1:
      def micro_step(m):
        self.strategy.run(self._micro_step_fn, args=(autograph.next_batch(iterator),))
        return m + 1
      tf.while_loop(lambda m: m < self.accumulation_steps - 1, micro_step, [tf.constant(0)],
                    maximum_iterations=self.accumulation_steps - 1)
    last_batch = autograph.next_batch(iterator)
    outputs = update.first_replica(
        self.strategy, self.strategy.run(self._update_step_fn, args=(last_batch,)))
    if self.statistics.enabled:
      # At the update's count, the step of the loss and `grad_norm` it sits beside in
      # TensorBoard (it was one behind them until 2026-12-07: a probe).
      self.statistics.write(self.statistics.active(self.global_step), outputs[3], outputs[4],
                            self.global_step + 1)
    self._count(*outputs[:3])

  def _count(self, scalars, grad_norm, applied):
    """Advances the counters and the loss scale after an update (cross-replica, traced)."""
    self.global_step.assign_add(1)
    self.micro_batches_seen.assign_add(self.accumulation_steps)
    skipped = 1 - tf.cast(applied, tf.int64)
    self.skipped_updates.assign_add(skipped)
    self.consecutive_skips.assign((self.consecutive_skips + 1) * skipped)
    self.loop_sums.assign_add(tf.where(applied, scalars, tf.zeros_like(scalars)))
    self.last_grad_norm.assign(grad_norm)
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
    self._loop_start = (time.perf_counter(), int(self.global_step.numpy()),
                        int(self.skipped_updates.numpy()))
    self.skip_window.start(*self._loop_start[1:])

  def train_loop_end(self):
    """Loop metrics (TensorBoard scalars via the Controller) and one fixed-format log line."""
    start_time, start_step, start_skipped = self._loop_start
    elapsed = max(time.perf_counter() - start_time, 1e-9)
    step = int(self.global_step.numpy())
    sums = self.loop_sums.numpy()
    weight = float(sums[1])
    # A loop whose updates were all skipped (or whose examples all weigh 0) has no mean loss:
    # NaN, not the 0.0 that read as a perfect loss in TensorBoard (a probe, 2026-12-06).
    # Negative weights count as given, as in the update and in evaluation.
    mean = lambda total: float(total) / weight if weight != 0 else float("nan")
    steps_per_s = (step - start_step) / elapsed
    examples_per_s = steps_per_s * self.accumulation_steps * self.config.batch_size
    eta = max(self.config.train_steps - step, 0) / max(steps_per_s, 1e-9)
    output = {"loss": mean(sums[0]), "learning_rate": float(self.current_learning_rate()),
              "examples_per_second": examples_per_s, "grad_norm": float(self.last_grad_norm.numpy()),
              "skipped_updates": int(self.skipped_updates.numpy()),
              "micro_steps": int(self.micro_batches_seen.numpy()),
              "examples_seen": int(self.micro_batches_seen.numpy()) * self.config.batch_size}
    for i, name in enumerate(self.task.metric_names):
      output[name] = mean(sums[2 + i])
    if self.loss_scale is not None:
      output["loss_scale"] = float(self.loss_scale.numpy())
    shown = "".join(f" | {name} {output[name]:.4f}" for name in self.task.metric_names[:1])
    logging.info("train step %d/%d | loss %.4f%s | %.1f steps/s | %.0f examples/s | "
                 "ETA %ds | lr %.3g | skipped %d", step, self.config.train_steps, output["loss"],
                 shown, steps_per_s, examples_per_s, eta, output["learning_rate"],
                 output["skipped_updates"])
    if output["skipped_updates"] > start_skipped:  # Else only a number in the line above.
      logging.warning("%d of updates %d..%d were skipped, weights unchanged (%s)",
                      output["skipped_updates"] - start_skipped, start_step + 1, step, _SKIP_CAUSES)
    if not self._warned_state_writes:  # After the first loop: the step is traced.
      self._warned_state_writes = True
      replica_state.warn_state_writes(self._state, self.accumulation_steps,
                                      self.config.batch_size, self.strategy.num_replicas_in_sync)
    limit = int(self.config.max_consecutive_skips)
    if limit and int(self.consecutive_skips.numpy()) >= limit:
      raise FloatingPointError(
          f"{int(self.consecutive_skips.numpy())} consecutive updates had non-finite loss or "
          f"gradients (`max_consecutive_skips`={limit}; {_SKIP_CAUSES}); stopping instead of "
          "training on garbage")
    self.skip_window.check(step, output["skipped_updates"])
    return output

  def current_learning_rate(self) -> float:
    """The schedule's value at the current `optimizer.iterations` (eager)."""
    return float(tf.convert_to_tensor(self.optimizer.learning_rate))
