"""Shared test helpers: tiny configs, a trainer built by the real `run.build`, and the reference.

The reference is the thing accumulation must equal: a plain Keras optimizer on ONE device, fed
the concatenated batch of an update (k micro-batches x all replicas), with Keras' own
`global_clipnorm` (correct on one device, on dense gradients) and loss Σ w·l / Σ w.
"""
import glob
import os

import numpy as np
import tensorflow as tf

from trainer import base_task
from trainer import config_defaults
from trainer import data
from trainer import optimizers
from trainer import run
from trainer import sources
from trainer import tasks


def summary_events(directory) -> dict:
  """{tag: [(step, value as a numpy array), ...]} of the TensorBoard event files in `directory`."""
  found = {}
  for path in sorted(glob.glob(os.path.join(str(directory), "events.out.tfevents.*"))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        number = (tf.make_ndarray(value.tensor) if value.HasField("tensor")
                  else np.asarray(value.simple_value))
        found.setdefault(value.tag, []).append((event.step, number))
  return found


def evaluated_updates(workdir) -> list:
  """The updates at which `workdir/summaries/eval` holds an evaluation, in order, repeats kept."""
  return sorted(step for step, _ in summary_events(
      os.path.join(str(workdir), "summaries", "eval")).get("loss", []))


def tiny_config(**overrides):
  """An MLP on generated data; overrides use dotted names: {"optimizer.name": "sgd"}."""
  config = config_defaults.base_config()
  config.model = "mlp"
  config.data.source = "synthetic"
  config.data.synthetic_train_examples = 512
  config.data.synthetic_test_examples = 64
  config.batch_size = 16
  config.eval_batch_size = 32
  config.train_steps = 3
  config.steps_per_loop = 3
  config.eval_every = 3
  config.checkpoint_every = 3
  config.export_at_end = False
  config.optimizer.learning_rate = 0.05
  for key, value in overrides.items():
    node = config
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return config


def build(config, workdir, task=None):
  """Strategy and trainer from the real builder (no Controller)."""
  strategy, trainer, _, _, _ = run.build(config, str(workdir), task)
  return strategy, trainer


def train_source(config, task=None):
  task = task or tasks.create_task(config)
  return sources.as_source(task.train_data(), "train_data()")


def local_values(strategy, variable):
  value = getattr(variable, "value", variable)
  return [np.array(v) for v in strategy.experimental_local_results(value)]


def snapshot(strategy, trainer):
  """First-replica numpy copies of weights, optimizer variables (slots, iterations)."""
  weights = [local_values(strategy, v)[0] for v in trainer.model.trainable_variables]
  slots = [local_values(strategy, v)[0] for v in trainer.optimizer.variables]
  return weights, slots


def update_batches(config, num_updates, task=None, source=None):
  """The concatenated batch of each update: stream positions [u*k*B, (u+1)*k*B)."""
  source = source or train_source(config, task)
  per_update = config.accumulation.steps * config.batch_size
  return [data.batch_at(source, tf.range(u * per_update, (u + 1) * per_update, dtype=tf.int64),
                        seed=config.seed, shuffle=config.data.shuffle)
          for u in range(num_updates)]


def reference_model(config, task, initial_weights):
  """A fresh model at `initial_weights` and a built optimizer clipping as Keras does (one
  device, dense gradients): the reference side of the exactness tests."""
  model = task.build_model()
  for var, value in zip(model.trainable_variables, initial_weights):
    var.assign(value)
  optimizer = optimizers.create_optimizer(config.optimizer, config.train_steps,
                                          global_clipnorm_in_keras=True)
  optimizer.build(model.trainable_variables)
  return model, optimizer


def reference_run(config, initial_weights, batches, task=None):
  """Plain single-device updates on whole batches; returns (weights, optimizer variables)."""
  task = task or tasks.create_task(config)
  model, optimizer = reference_model(config, task, initial_weights)

  @tf.function
  def step(batch):
    with tf.GradientTape() as tape:
      loss, weight, _ = base_task.weighted_outputs(task, model, batch, training=True)
      loss = tf.reduce_sum(loss * weight) / tf.reduce_sum(weight)
    grads = tape.gradient(loss, model.trainable_variables)
    # Dense gradients: Keras clips IndexedSlices by the norm of the slices, not of the gradient.
    # None (a variable the loss does not reach) stays None: Keras leaves such a variable out.
    grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  for batch in batches:
    step(batch)
  return ([np.array(v) for v in model.trainable_variables],
          [np.array(v) for v in optimizer.variables])


def max_abs_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(a, b))


class WithBatchWeights(tasks.task_class("classification")):
  """The classification task, with per-example weights read from a batch field `weight`."""

  def __init__(self, config, weight_fn):
    super().__init__(config)
    self._weight_fn = weight_fn

  def train_data(self):
    source = super().train_data()

    def take(ids, positions):
      return dict(source.take(ids, positions), weight=self._weight_fn(positions))
    return base_task.ExampleSource(source.num_examples, take)

  def per_example_loss(self, model, batch, training):
    out = super().per_example_loss(model, {k: v for k, v in batch.items() if k != "weight"},
                                   training)
    # Evaluation data (the classification task's) has no `weight`: ones there.
    return base_task.LossOutput(loss=out.loss, weight=batch.get("weight"), metrics=out.metrics)


# ----------------------------------------------------------------------------- the CLI ---------
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")


def run_cli(workdir, config_arg, *overrides, cwd=None, timeout=300, extra_env=None, flags=()):
  """`python -m trainer.main --config=CONFIG --workdir=W --config.O ... FLAGS` in a subprocess.

  `config_arg` is relative to the repository unless absolute. The repository and tests/ are on
  PYTHONPATH, so tasks in tests/ (example_tasks) import by path. Returns the CompletedProcess.
  """
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  config = config_arg if os.path.isabs(config_arg) else os.path.join(REPO, config_arg)
  cmd = ["timeout", "-k", "5", str(timeout), sys.executable, "-m", "trainer.main",
         f"--config={config}", f"--workdir={workdir}"] + [f"--config.{o}" for o in overrides] + list(flags)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=os.pathsep.join([REPO, TESTS, os.environ.get("PYTHONPATH", "")]))
  env.update(extra_env or {})
  return subprocess.run(cmd, cwd=cwd or REPO, capture_output=True, text=True,
                        timeout=timeout + 20, env=env, check=False)


def checkpoint_weights(workdir) -> tuple:
  """(path, {key: array}) of the model weights in the latest checkpoint of a run's workdir."""
  path = tf.train.latest_checkpoint(os.path.join(str(workdir), "checkpoints"))
  reader = tf.train.load_checkpoint(path)
  names = sorted(n for n in reader.get_variable_to_shape_map() if n.startswith("weights/"))
  assert names, "the checkpoint must hold the model's variables"
  return path, {n: reader.get_tensor(n) for n in names}


def assert_same_weights(workdir_a, workdir_b):
  """Bitwise equality of the latest checkpoints' weights of two runs."""
  path_a, a = checkpoint_weights(workdir_a)
  path_b, b = checkpoint_weights(workdir_b)
  assert os.path.basename(path_a) == os.path.basename(path_b), (path_a, path_b)
  assert a.keys() == b.keys()
  for name in a:
    assert np.array_equal(a[name], b[name]), name


def assert_resume_is_bitwise(tmp_path, recipe, *overrides, stop_at=2, train_steps=6):
  """Trains `train_steps` updates in one CLI run, and in two (stopping after `stop_at`, then
  rerunning to `train_steps`); asserts the second run resumed and both end with bitwise equal
  weights. Returns the (full, resumed second) CompletedProcesses."""
  full = run_cli(tmp_path / "full", recipe, f"train_steps={train_steps}", *overrides)
  assert full.returncode == 0, full.stderr[-2000:]
  first = run_cli(tmp_path / "resumed", recipe, f"train_steps={stop_at}", *overrides)
  assert first.returncode == 0, first.stderr[-2000:]
  second = run_cli(tmp_path / "resumed", recipe, f"train_steps={train_steps}", *overrides)
  assert second.returncode == 0, second.stderr[-2000:]
  assert "restored" in second.stderr and f"at update {stop_at}" in second.stderr
  assert_same_weights(tmp_path / "full", tmp_path / "resumed")
  return full, second


# ------------------------------------------------------------------- damaged workdirs -------
def damage_checkpoint(workdir, how):
  """Damages the workdir's ckpt-6 (or its state file) as `how` says; returns its prefix."""
  ckpts = workdir / "checkpoints"
  newest = ckpts / "ckpt-6"
  if how == "state_deleted":
    (ckpts / "checkpoint").unlink()
  elif how == "state_garbage":
    (ckpts / "checkpoint").write_text("\x00\x01 not a checkpoint state {{{")
  elif how == "state_names_missing":
    (ckpts / "checkpoint").write_text('model_checkpoint_path: "ckpt-99"\n')
  elif how == "state_older":  # A kill between ckpt-6's files and the state file leaves this.
    (ckpts / "checkpoint").write_text('model_checkpoint_path: "ckpt-4"\n'
                                      'all_model_checkpoint_paths: "ckpt-4"\n')
  elif how == "data_truncated":
    data = next(ckpts.glob("ckpt-6.data-*"))
    data.write_bytes(data.read_bytes()[:50])
  elif how == "data_zeroed":
    data = next(ckpts.glob("ckpt-6.data-*"))
    data.write_bytes(b"\x00" * len(data.read_bytes()))
  elif how == "index_missing":
    (ckpts / "ckpt-6.index").unlink()
  elif how == "index_garbage":
    (ckpts / "ckpt-6.index").write_bytes(b"garbage" * 10)
  return newest
