"""`run(config, workdir)`: build everything, restore, then drive the Orbit Controller.

Phases (eager, host): validate -> strategy -> data -> model & optimizer -> trainer & evaluator ->
checkpoint restore -> datasets positioned after the restored step -> Controller -> mode.
"""
import contextlib
import json
import math
import os
import shutil

from absl import logging
import keras
import orbit
import tensorflow as tf

from trainer import data
from trainer import optimizers
from trainer import orbit_evaluator
from trainer import orbit_trainer
from trainer import preemption
from trainer import strategies
from trainer import tasks
from trainer import validation


def _check_workdir(workdir: str) -> None:
  if workdir.startswith("gs://"):
    return
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write_probe.{os.getpid()}")  # Workers may share workdir.
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise validation.ConfigError(f"`--workdir`={workdir!r} is not writable: {e.strerror}") from None


def _is_chief(strategy) -> tuple[bool, int]:
  resolver = getattr(strategy, "cluster_resolver", None)
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
    return True, 0
  task_type, task_id = resolver.task_type, resolver.task_id or 0
  has_chief_task = "chief" in resolver.cluster_spec().as_dict()
  is_chief = task_type in (None, "chief") or (
      task_type == "worker" and task_id == 0 and not has_chief_task)
  return is_chief, task_id


def _distribute(strategy, global_batch, make_batch, start_batch=0, num_batches=None):
  return strategy.distribute_datasets_from_function(
      lambda ctx: data.stream(ctx, global_batch, make_batch, start_batch, num_batches))


def build(config, workdir):
  """Builds strategy, task, trainer, evaluator and checkpoint manager; restores (eager)."""
  validation.validate(config)
  _check_workdir(workdir)
  if config.deterministic:
    tf.config.experimental.enable_op_determinism()
  keras.utils.set_random_seed(config.seed)
  strategy = strategies.create_strategy(config)
  validation.validate_replicas(config, strategy.num_replicas_in_sync)
  task = tasks.create_task(config)
  train_batch, eval_batch = task.batch_fn("train"), task.batch_fn("test")  # Fails early on bad data.
  is_chief, worker_id = _is_chief(strategy)
  num_train = len(data.load_arrays(config.data, "train")[1])
  if config.batch_size // strategy.num_replicas_in_sync > num_train:
    raise validation.ConfigError(
        f"`batch_size`={config.batch_size} gives each replica more examples than the "
        f"{num_train} of the training split; allowed: at most {num_train} per replica")
  with strategy.scope():
    model = task.build_model()
    optimizer = optimizers.create_optimizer(config.optimizer, config.train_steps)
  trainer = orbit_trainer.Trainer(config=config, strategy=strategy, task=task, model=model,
                                  optimizer=optimizer, train_dataset=None)
  checkpoint = tf.train.Checkpoint(**trainer.checkpoint_items())
  chief_dir = os.path.join(workdir, "checkpoints")
  own_dir = chief_dir if is_chief else os.path.join(workdir, f"tmp_worker_{worker_id}")
  if not is_chief and tf.io.gfile.exists(own_dir):
    tf.io.gfile.rmtree(own_dir)  # Non-chief copies are scratch: always restore from the chief's.
  manager = tf.train.CheckpointManager(
      checkpoint, own_dir, max_to_keep=config.keep_checkpoints if is_chief else 1,
      step_counter=trainer.global_step, checkpoint_interval=config.checkpoint_every)
  latest = tf.train.latest_checkpoint(chief_dir)
  if latest:  # Before the datasets exist: they start at the restored data position. (The
    # Controller restores the same checkpoint again on the chief; that is harmless.)
    try:
      with strategy.scope():
        checkpoint.restore(latest).assert_existing_objects_matched()
    except (AssertionError, ValueError) as e:
      raise validation.ConfigError(
          f"the checkpoint {latest} does not match this config (model, optimizer or "
          f"mixed_precision changed?); use a fresh `--workdir` ({type(e).__name__})") from None
    logging.info("restored %s at update %d", latest, int(trainer.global_step.numpy()))
  if is_chief:  # Only once the workdir is known to fit this config.
    with tf.io.gfile.GFile(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  start = int(trainer.micro_batches_seen.numpy())
  trainer.train_dataset = _distribute(strategy, config.batch_size, train_batch, start_batch=start)
  num_test = len(data.load_arrays(config.data, "test")[1])
  eval_steps = (math.ceil(num_test / config.eval_batch_size) if config.eval_steps == -1
                else config.eval_steps)
  evaluator = orbit_evaluator.Evaluator(
      strategy=strategy, task=task, model=model,
      eval_dataset=_distribute(strategy, config.eval_batch_size, eval_batch, 0, eval_steps))
  return strategy, trainer, evaluator, manager, eval_steps


def run(config, workdir: str) -> dict:
  """Trains and/or evaluates as `config.mode` says; returns the last outputs (eager, host)."""
  strategy, trainer, evaluator, manager, eval_steps = build(config, workdir)
  is_chief = _is_chief(strategy)[0]
  summaries = os.path.join(workdir, "summaries")
  watcher = preemption.PreemptionWatcher(strategy, manager, trainer.global_step)
  controller = orbit.Controller(
      strategy=strategy, trainer=trainer, evaluator=evaluator, global_step=trainer.global_step,
      steps_per_loop=config.steps_per_loop, checkpoint_manager=manager,
      summary_interval=config.summary_every or None,
      summary_dir=os.path.join(summaries, "train"),
      eval_summary_dir=os.path.join(summaries, "eval"), train_actions=[watcher])
  result = {}
  training = config.mode in ("train", "train_and_eval")
  with watcher.installed() if training else contextlib.nullcontext():
    try:
      if config.mode == "train":
        controller.train(steps=config.train_steps)
      elif config.mode == "eval":
        result["eval"] = controller.evaluate(steps=eval_steps)
      elif config.mode == "train_and_eval":
        result["eval"] = controller.train_and_evaluate(
            train_steps=config.train_steps, eval_steps=eval_steps, eval_interval=config.eval_every)
      else:
        result["eval"] = controller.evaluate_continuously(steps=eval_steps,
                                                          timeout=config.eval_timeout_s)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.CancelledError) as e:
      raise preemption.PeerLostError(
          f"a multi-worker peer stopped answering ({type(e).__name__}); restart all workers to "
          f"resume from the last checkpoint") from e
  result["global_step"] = int(trainer.global_step.numpy())
  result["skipped_updates"] = int(trainer.skipped_updates.numpy())
  result = json.loads(json.dumps(result, default=float))
  if is_chief:
    with tf.io.gfile.GFile(os.path.join(workdir, "result.json"), "w") as f:
      json.dump(result, f, indent=2)
  else:
    shutil.rmtree(manager.directory, ignore_errors=True)
  return result
