"""`run(config, workdir, task=None)`: build everything, restore, then drive the Orbit Controller.

Phases (eager, host): validate -> strategy -> task and its data -> model & optimizer -> trainer
-> checkpoint restore -> datasets positioned after the restored update -> evaluator ->
Controller -> mode. The runner knows no dataset: everything about the data comes from the task
(`trainer.base_task`) through `trainer.data`.
"""
import contextlib
import functools
import json
import math
import os
import shutil

from absl import logging
import keras
import orbit
import tensorflow as tf

from trainer import base_task
from trainer import checkpointing
from trainer import data
from trainer import errors
from trainer import evaluated
from trainer import export
from trainer import host_iterator
from trainer import optimizers
from trainer import orbit_evaluator
from trainer import orbit_trainer
from trainer import preemption
from trainer import reading_controller
from trainer import shutdown
from trainer import sources
from trainer import step_errors
from trainer import strategies
from trainer import tasks
from trainer import validation
from trainer import workdir as workdir_lib


def _resume_iterator(config, strategy) -> bool:
  """Whether a tf.data source resumes by restoring its iterator (else by skipping batches)."""
  if config.data.resume != "auto":
    return config.data.resume == "iterator"
  return not isinstance(strategy, tf.distribute.TPUStrategy)


def _train_dataset(config, strategy, source, start: int):
  """Distributed training batches from micro-batch `start` on (random access or skip)."""
  def dataset_fn(ctx):
    if isinstance(source, sources.DatasetFactory):
      return data.factory_train_stream(ctx, source, config.batch_size, skip_batches=start)
    return data.train_stream(ctx, source, config.batch_size, seed=config.seed,
                             shuffle=config.data.shuffle, start_batch=start)
  return strategy.distribute_datasets_from_function(dataset_fn)


def _eval_dataset(config, strategy, source):
  steps = data.eval_steps(source, config.eval_batch_size)
  if config.eval_steps > 0:
    steps = config.eval_steps if steps == -1 else min(steps, config.eval_steps)

  def dataset_fn(ctx):
    if isinstance(source, sources.DatasetFactory):
      dataset = data.factory_eval_stream(ctx, source, config.eval_batch_size)
      if (steps == -1 and config.mode in validation.EVALUATING_MODES
          and dataset.cardinality() == tf.data.INFINITE_CARDINALITY):  # It hung, deaf to signals.
        raise errors.DataError(
            f"eval_data() ({source.name!r}) repeats without end (tf.data cardinality infinite), "
            "so an evaluation would never finish; drop its .repeat(), or set `eval_steps` "
            "(allowed: a number of batches > 0)")
      return dataset if steps == -1 else dataset.take(steps * data.local_replicas(ctx))
    return data.eval_stream(ctx, source, config.eval_batch_size, num_batches=steps)
  return strategy.distribute_datasets_from_function(dataset_fn), steps


def _train_and_evaluate(controller, config, eval_steps: int, already_evaluated) -> dict:
  """Trains to `config.train_steps`, evaluating at every multiple of `config.eval_every` and at
  the end; returns the last evaluation (eager, host).

  Orbit's `train_and_evaluate` counts its interval from the step it starts at: after a resume
  at update 450, `eval_every`=300 evaluated at 750 and 1050 instead of 600 and 900. The first
  stretch is trained up to the next multiple here, and Orbit's loop takes it from there. A run
  resumed AT a multiple evaluates it first: the run before may have stopped before evaluating.
  `already_evaluated(step)` says whether it did, on the same weights (`trainer.evaluated`).
  """
  step, every, last = int(controller.global_step.numpy()), config.eval_every, config.train_steps
  if step >= last:  # Already trained: evaluate the final weights (e.g. a restart after a stop
    return controller.evaluate(steps=eval_steps)  # during the final evaluation).
  if step and step % every == 0 and not already_evaluated(step):  # Resumed at a multiple: a
    controller.evaluate(steps=eval_steps)  # stop in the loop that reached it came before it.
  if step % every:
    aligned = min(last, (step // every + 1) * every)
    controller.train(steps=aligned, checkpoint_at_completion=aligned == last)
    evaluation = controller.evaluate(steps=eval_steps)
    if aligned == last:
      return evaluation
  return controller.train_and_evaluate(train_steps=last, eval_steps=eval_steps,
                                       eval_interval=every)


def _write_summaries(summary_manager, output) -> None:
  """Writes a loop's output as Orbit's Controller does after its actions (eager, host)."""
  summary_manager.write_summaries(tf.nest.map_structure(orbit.utils.get_value, output))
  summary_manager.flush()


def _strict_json(value):
  """Numbers as JSON allows them: NaN and infinities become null (strict parsers reject them)."""
  value = json.loads(json.dumps(value, default=float))
  def clean(v):
    if isinstance(v, float) and not math.isfinite(v):
      return None
    if isinstance(v, dict):
      return {k: clean(x) for k, x in v.items()}
    return [clean(x) for x in v] if isinstance(v, list) else v
  return clean(value)


@contextlib.contextmanager
def _dtype_policy(name: str):
  """Keras' global dtype policy is `name` (`config.mixed_precision`) while the task builds its
  model, so that layers created without a `dtype` follow the config; restored afterwards."""
  previous = keras.config.dtype_policy()
  keras.config.set_dtype_policy(name)
  try:
    yield
  finally:
    keras.config.set_dtype_policy(previous)


def _check_eval_fields(task, model, train_source, eval_source, batch_size) -> None:
  """Eager, host, at start: evaluation data that lacks a field of the training data is traced
  through the task's loss once (nothing runs); a field the loss reads raises DataError now,
  not as a traceback at the first evaluation, after training. Fields only training reads pass.

  `train_source` None (reading modes, which never build the training pipeline): the evaluation
  data is traced whatever its fields.
  """
  eval_spec = export.batch_spec(eval_source, batch_size)
  if not isinstance(eval_spec, dict):
    return
  missing = []
  if train_source is not None:
    train_spec = export.batch_spec(train_source, batch_size)
    if not isinstance(train_spec, dict):
      return
    missing = sorted(set(train_spec) - set(eval_spec))
    if not missing:
      return
  trace = tf.function(lambda batch: base_task.weighted_outputs(task, model, batch, False),
                      autograph=False)
  try:
    trace.get_concrete_function(eval_spec)
  except KeyError as e:
    field = e.args[0] if e.args else missing[0]
    also = f"; train_data() also has {', '.join(missing)}" if missing else ""
    raise errors.DataError(
        f"eval_data() has no field {field!r}, which {type(task).__name__} reads in evaluation; "
        f"its fields: {', '.join(sorted(k for k in eval_spec if k != sources.VALID_KEY))}"
        f"{also}") from None
  except Exception:  # pylint: disable=broad-except  (Anything else: the evaluation reports it.)
    return


def _checkpointed_update(manager, global_step):
  """`global_step` if the manager's newest checkpoint is of that update, else None (eager)."""
  step, latest = int(global_step.numpy()), manager.latest_checkpoint
  return step if latest and latest.endswith(f"-{step}") else None


def build(config, workdir, task=None):
  """Builds strategy, task, trainer, evaluator and checkpoint manager; restores (eager).

  Returns (strategy, trainer, evaluator or None, checkpoint manager, eval steps).
  """
  validation.validate(config)
  workdir_lib.check_writable(workdir)
  if config.deterministic:
    tf.config.experimental.enable_op_determinism()
  keras.utils.set_random_seed(config.seed)
  strategy = strategies.create_strategy(config)
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    shutdown.reinstall()  # TF's C++ preemption notifier took SIGTERM over; take it back.
  validation.validate_replicas(config, strategy.num_replicas_in_sync)
  task = task if task is not None else tasks.create_task(config)
  train_source = sources.as_source(task.train_data(), "train_data()")
  eval_data = task.eval_data()
  eval_source = None if eval_data is None else sources.as_source(eval_data, "eval_data()")
  num_train = sources.num_examples(train_source)
  if num_train is not None and config.batch_size // strategy.num_replicas_in_sync > num_train:
    raise errors.ConfigError(
        f"`batch_size`={config.batch_size} gives each replica more examples than the "
        f"{num_train} of the training data; allowed: at most {num_train} per replica")
  chief, worker_id = strategies.worker_role(strategy)
  training = config.mode in validation.TRAINING_MODES
  with strategy.scope(), _dtype_policy(config.mixed_precision):
    model = task.build_model()
    optimizer = optimizers.create_optimizer(config.optimizer, config.train_steps)
  base_task.check_contract(task, model)
  base_task.check_model_fits_run(task, model, strategy, config.mixed_precision)
  if chief and (config.mode == "export" or (training and config.export_at_end)):
    export.check_exportable(model)
  if eval_source is not None and config.mode in validation.EVALUATING_MODES:
    _check_eval_fields(task, model, train_source if training else None, eval_source,
                       config.eval_batch_size)
  trainer = orbit_trainer.Trainer(config=config, strategy=strategy, task=task, model=model,
                                  optimizer=optimizer, train_dataset=None)
  # Their specs give a subclassed model's export signature. Reading modes try the evaluation
  # data first: their machine may hold nothing else (train_data() is still called, as a task
  # may set state there, but its pipeline is built only if the evaluation data's cannot serve).
  trainer.signature_sources = ([train_source] if training or eval_source is None
                               else [eval_source, train_source])
  checkpoint = tf.train.Checkpoint(**trainer.checkpoint_items())
  checkpoints = checkpointing.checkpoint_dir(workdir)
  # Multi-worker: the same newest checkpoint on every worker before any restore (a restore
  # broadcasts from worker 0), and the same restored update after it.
  newest = checkpointing.newest_number(checkpoints)
  checkpointing.check_workers_agree(strategy, newest, "the newest checkpoint in their workdirs")
  if newest != checkpointing.NO_CHECKPOINT:
    workdir_lib.check_resume(config, workdir)  # Names the changed field, before any restore.
  # Before the datasets exist: they start at the restored data position. (The Controller
  # restores the same checkpoint again on the chief; that is harmless.) Only a training chief
  # repairs: an evaluator beside a live trainer reads and never writes.
  latest = checkpointing.restore_newest_intact(checkpoint, checkpoints, strategy,
                                               repair=chief and training)
  checkpointing.check_workers_agree(strategy, int(trainer.global_step.numpy()),
                                    "the update they restored")
  trainer.restored_checkpoint = latest
  if latest:
    logging.info("restored %s at update %d", latest, int(trainer.global_step.numpy()))
  if training:  # The kept checkpoints' skip counts: `max_skipped_fraction` spans restarts.
    trainer.skip_window.seed(strategy, checkpoints, int(trainer.global_step.numpy()),
                             int(trainer.skipped_updates.numpy()))
  if chief and training:  # Only once the workdir is known to fit this config.
    workdir_lib.write_atomically(os.path.join(workdir, "config.json"),
                                 config.to_json_best_effort(indent=2))
    checkpointing.remove_partial_saves(checkpoints)  # Of a save that was killed or failed.
  if training:  # Each worker writes (and holds the lock of) its own iterator checkpoints.
    checkpointing.remove_partial_saves(checkpointing.data_state_dir(workdir, worker_id))

  start = int(trainer.micro_batches_seen.numpy())
  iterator = None
  # Reading modes (eval, export) never draw training batches: no iterator to restore, no
  # warning about one (a probe, 2026-12-07).
  if (training and isinstance(train_source, sources.DatasetFactory)
      and _resume_iterator(config, strategy)):
    num_workers = strategies.num_workers(strategy)
    make = lambda skip: host_iterator.HostIterator(
        strategy, lambda ctx: data.factory_train_stream(ctx, train_source, config.batch_size,
                                                        skip_batches=skip),
        num_workers=num_workers, worker_id=worker_id)
    iterator = make(0)
    unsaveable = host_iterator.unsaveable_state(iterator.checkpointable)
    if unsaveable and config.data.resume == "iterator":
      raise errors.ConfigError(
          f"`data.resume`=iterator but TensorFlow cannot save the tf.data source's iterator "
          f"({unsaveable}: Python or random state, e.g. a py_function, from_generator or an "
          "unseeded random op); allowed: auto or skip")
    if unsaveable:
      logging.warning(
          "TensorFlow cannot save the tf.data source's iterator (%s): a restart resumes by "
          "skipping the micro-batches already consumed, which is exact only if the pipeline "
          "gives the same batches every time (seeded shuffles, stateless random ops)", unsaveable)
      iterator = None
  if iterator is not None:
    step = int(trainer.global_step.numpy())
    layout = (num_workers, strategy.num_replicas_in_sync // num_workers,
              config.batch_size // strategy.num_replicas_in_sync)
    if latest and not checkpointing.restore_data_state(iterator.checkpointable, workdir,
                                                       worker_id, step, layout):
      logging.warning("no usable input iterator of update %d: skipping the %d micro-batches "
                      "already consumed instead", step, start)
      iterator = make(start)
    trainer.train_dataset = iterator  # Orbit calls iter() on it: an iterator returns itself.
  else:
    if training and isinstance(train_source, sources.DatasetFactory) and start:
      logging.warning("tf.data source on %s: resuming by skipping the %d micro-batches already "
                      "consumed (no iterator checkpoints)", type(strategy).__name__, start)
    # (None in reading modes, which never draw a training batch.)
    trainer.train_dataset = (_train_dataset(config, strategy, train_source, start) if training
                             else None)
  manager = checkpointing.create_manager(
      checkpoint, workdir, is_chief=chief, worker_id=worker_id,
      step_counter=trainer.global_step, config=config,
      data_iterator=None if iterator is None else iterator.checkpointable,
      data_layout=() if iterator is None else layout)
  evaluator, eval_steps = None, 0
  if eval_source is not None:
    eval_dataset, eval_steps = _eval_dataset(config, strategy, eval_source)
    evaluator = orbit_evaluator.Evaluator(strategy=strategy, task=task, model=model,
                                          eval_dataset=eval_dataset)
    if training and not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
      # (Workers stop together, at a loop end: one alone leaving an evaluation's collectives
      # would leave the others waiting for it.)
      evaluator.checkpointed_update = functools.partial(_checkpointed_update, manager,
                                                        trainer.global_step)
  return strategy, trainer, evaluator, manager, eval_steps


def run(config, workdir: str, task=None) -> dict:
  """Trains, evaluates and/or exports as `config.mode` says; returns the last outputs (eager).

  `task`: a `trainer.base_task.Task` instance to use instead of `config.task` (notebooks).
  Holds the workdir lock (`trainer.workdir.Lock`) for the whole run: training runs take the
  workdir's (per worker); evaluators and exports, which only read checkpoints, take their own,
  so one can run beside a live trainer.
  """
  validation.validate(config)  # A bad field leaves no trace: no workdir made, no lock taken.
  workdir_lib.check_name(workdir)
  if config.mode in ("eval", "export") and not tf.io.gfile.isdir(workdir):
    # Before the lock and the writability probe create it: a mistyped path stays absent.
    raise errors.ConfigError(f"`mode`={config.mode} but `--workdir`={workdir!r} holds no "
                             "checkpoint (it does not exist); train first, or check the path")
  workdir_lib.check_writable(workdir)
  training = config.mode in validation.TRAINING_MODES
  lock = strategies.task_key(config) if training else config.mode
  with workdir_lib.Lock(workdir, lock, role=f"mode={config.mode}") as held:
    return _run(config, workdir, task, held)


def _run(config, workdir: str, task, lock) -> dict:
  strategy, trainer, evaluator, manager, eval_steps = build(config, workdir, task)
  manager.before_save = lock.check_held
  chief = strategies.worker_role(strategy)[0]
  if config.mode in ("eval", "continuous_eval") and evaluator is None:
    raise errors.ConfigError(f"`mode`={config.mode} but the task's eval_data() is None; "
                             "allowed: train, export")
  if config.mode in ("eval", "export") and trainer.restored_checkpoint is None:
    raise errors.ConfigError(
        f"`mode`={config.mode} but `--workdir`={workdir!r} holds no checkpoint (in "
        f"{checkpointing.checkpoint_dir(workdir)}); train first, or check the path")
  summaries = os.path.join(workdir, "summaries")
  watcher = preemption.PreemptionWatcher(strategy, manager, trainer.global_step,
                                         every_loop=lock.check_held)
  training = config.mode in validation.TRAINING_MODES
  if training and chief:
    workdir_lib.note_training_start(workdir, trainer.restored_checkpoint,
                                    int(trainer.global_step.numpy()), config.train_steps)
  controller_class = orbit.Controller if training else functools.partial(
      reading_controller.ReadingController, restored=trainer.restored_checkpoint,
      final_step=lambda: max(config.train_steps, workdir_lib.trained_to(workdir) or 0))
  writes = lambda manager: lambda output: _write_summaries(getattr(controller, manager), output)
  # Only the chief writes summaries: every MultiWorkerMirrored worker computes the same values,
  # and TensorBoard showed each point once per worker.
  controller = controller_class(
      strategy=strategy, trainer=trainer, evaluator=evaluator, global_step=trainer.global_step,
      steps_per_loop=config.steps_per_loop, checkpoint_manager=manager,
      summary_interval=config.summary_every or None,
      summary_dir=os.path.join(summaries, "train") if chief else None,
      eval_summary_dir=os.path.join(summaries, "eval") if chief else None,
      # A training chief records which weights it evaluated, once the summaries are written.
      eval_summary_manager=evaluated.RecordingSummaryManager(
          os.path.join(summaries, "eval"), trainer.global_step, workdir, trainer.model)
      if chief and training else None,
      train_actions=[watcher.action(writes("summary_manager"))],
      # A signal noted during an evaluation stops right after it, its results written.
      eval_actions=[watcher.action(writes("eval_summary_manager"))])
  result = {}
  with (watcher.installed() if training else contextlib.nullcontext(),
        step_errors.explained(workdir, training)):
    if config.mode == "train" or (config.mode == "train_and_eval" and evaluator is None):
      controller.train(steps=config.train_steps)
    elif config.mode == "eval":
      result["eval"] = controller.evaluate(steps=eval_steps)
    elif config.mode == "train_and_eval":
      result["eval"] = _train_and_evaluate(
          controller, config, eval_steps, lambda step: evaluated.already_evaluated(
              strategy, workdir, step, trainer.model, chief))
    elif config.mode == "continuous_eval":
      result["eval"] = controller.evaluate_continuously(steps=eval_steps,
                                                        timeout=config.eval_timeout_s)
  step = int(trainer.global_step.numpy())
  if chief and (config.mode == "export" or (training and config.export_at_end)):
    result["export"] = export.export_model(
        trainer.task, trainer.model, workdir, step, signature_sources=trainer.signature_sources,
        batch_size=config.batch_size // strategy.num_replicas_in_sync)
  result["global_step"] = step
  result["skipped_updates"] = int(trainer.skipped_updates.numpy())
  result = _strict_json(result)
  if chief:  # An evaluator beside a trainer keeps its own result file.
    name = "result.json" if training else f"result.{config.mode}.json"
    workdir_lib.write_atomically(os.path.join(workdir, name),
                                 json.dumps(result, indent=2, allow_nan=False))
  else:
    shutil.rmtree(manager.directory, ignore_errors=True)
  return result
