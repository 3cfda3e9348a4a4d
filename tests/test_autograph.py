"""AutoGraph converts the task's code, not microstep's own (trainer/autograph.py).

A task may write Python control flow on tensors in `per_example_loss`, `represent` and
`batch_loss`, as in any tf.function. microstep's traced code uses explicit TensorFlow control
flow and is traced as written (converting it cost seconds at the start of every run).
"""
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.autograph.impl import api as autograph_api  # pylint: disable=g-direct-tensorflow-import

import example_tasks
import helpers
from trainer import base_task
from trainer import run
from trainer.tasks import batch_losses


class TensorBranches(example_tasks.NoMetrics):
  """NoMetrics' loss written with an `if` and a `for` on tensors: the same values, bit for bit."""

  def per_example_loss(self, model, batch, training):
    loss = example_tasks._xent(model, batch, training)[0]  # pylint: disable=protected-access
    if tf.reduce_max(loss) > 1e30:  # Never true. In a graph, only AutoGraph makes this an `if`.
      loss = tf.zeros_like(loss)
    total = tf.zeros_like(loss)
    for _ in tf.range(2):  # Two halves: exact.
      total += 0.5 * loss
    return base_task.LossOutput(loss=total)


class BranchingPairs(batch_losses.ContrastivePairs):
  """ContrastivePairs with tensor `if`s in `represent` and `batch_loss` that change nothing."""

  def represent(self, model, batch, training):
    representations = super().represent(model, batch, training)
    if tf.reduce_any(tf.math.is_nan(representations["a"])):
      representations["a"] = tf.zeros_like(representations["a"])
    return representations

  def batch_loss(self, representations, valid):
    out = super().batch_loss(representations, valid)
    loss = out.loss
    if loss > 1e30:
      loss = tf.zeros_like(loss)
    return base_task.BatchLossOutput(loss=loss, metrics=out.metrics)


class BranchingHistogram(batch_losses.HistogramChiSquare):
  """A user's subclass of a built-in task overrides a helper its inherited `batch_loss` calls."""

  def _soft_counts(self, values, valid):
    counts = super()._soft_counts(values, valid)
    if tf.reduce_any(counts < 0):
      counts = tf.zeros_like(counts)
    return counts


def _final_weights(workdir):
  return helpers.checkpoint_weights(workdir)[1]


@pytest.mark.parametrize("strategy,replicas,steps,more", [
    ("default", 0, 1, {}), ("mirrored", 2, 2, {}),
    # XLA-compiled replica functions, statistics recorded in the update's pass, fp16 scaling.
    ("default", 0, 2, {"xla": "on", "per_example.every_steps": 1}),
    ("default", 0, 2, {"mixed_precision": "mixed_float16"})])
def test_a_loss_with_python_control_flow_on_tensors_trains_and_evaluates(tmp_path, strategy,
                                                                        replicas, steps, more):
  config = helpers.tiny_config(**{"strategy": strategy, "cpu_replicas": replicas,
                                  "accumulation.steps": steps, "mode": "train_and_eval", **more})
  results = {}
  for task_class in (example_tasks.NoMetrics, TensorBranches):
    workdir = tmp_path / task_class.__name__
    results[task_class] = run.run(config, str(workdir), task=task_class(config))
    results[task_class]["weights"] = _final_weights(workdir)
  plain, branching = results[example_tasks.NoMetrics], results[TensorBranches]
  assert branching["global_step"] == plain["global_step"] == 3
  assert branching["eval"]["loss"] == plain["eval"]["loss"]
  for name, value in plain["weights"].items():
    np.testing.assert_array_equal(branching["weights"][name], value, err_msg=name)


@pytest.mark.parametrize("plain,branching", [
    (batch_losses.ContrastivePairs, BranchingPairs),
    (batch_losses.HistogramChiSquare, BranchingHistogram)])
def test_a_batch_loss_with_python_control_flow_on_tensors_trains_with_gradcache(tmp_path, plain,
                                                                                branching):
  config = helpers.tiny_config(**{"task": "contrastive_pairs", "accumulation.mode": "gradcache",
                                  "accumulation.steps": 2, "strategy": "mirrored",
                                  "cpu_replicas": 2, "train_steps": 2,
                                  "histogram.train_examples": 512})
  weights = []
  for task in (plain(config), branching(config)):
    strategy, trainer = helpers.build(config, tmp_path / type(task).__name__, task)
    trainer.train(tf.constant(2))
    weights.append(helpers.snapshot(strategy, trainer)[0])
  assert helpers.max_abs_diff(weights[0], weights[1]) == 0.0


class StreamedBranches(example_tasks.Streamed):
  """Streamed (a tf.data factory, a map of the user's) with a tensor `if` in its loss."""

  def per_example_loss(self, model, batch, training):
    out = super().per_example_loss(model, batch, training)
    loss = out.loss
    if tf.reduce_max(loss) > 1e30:
      loss = tf.zeros_like(loss)
    return base_task.LossOutput(loss=loss, metrics=out.metrics)


@pytest.mark.parametrize("task_class,replicas", [(TensorBranches, 0), (StreamedBranches, 2)])
def test_only_the_task_s_code_is_converted(tmp_path, task_class, replicas):
  converted = []
  original = autograph_api._convert_actual  # pylint: disable=protected-access

  def recording(entity, program_ctx):
    converted.append(f"{entity.__module__}.{entity.__qualname__}")
    return original(entity, program_ctx)
  config = helpers.tiny_config(**{"accumulation.steps": 2, "train_steps": 1, "steps_per_loop": 1,
                                  "eval_every": 1, "mode": "train_and_eval",
                                  "export_at_end": True})
  if replicas:
    config.update({"strategy": "mirrored", "cpu_replicas": replicas})
  with mock.patch.object(autograph_api, "_convert_actual", recording):
    run.run(config, str(tmp_path), task=task_class(config))
  assert f"test_autograph.{task_class.__name__}.per_example_loss" in converted, converted
  ours = [name for name in converted if name.startswith("trainer.")]
  assert not ours, f"microstep's own code was converted by AutoGraph: {ours}"
