"""Exact big-batch gradients for batch-level losses (issue 12): `accumulation.mode=gradcache`.

The reference is ONE step of the same loss on the concatenated batch of the update on one
device (`helpers.reference_run`: for a BatchLossTask its loss is `batch_loss` of every
representation of that batch). Plain averaging (`sum`) is shown to differ measurably.
"""
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import helpers
from trainer import base_task
from trainer import collectives
from trainer import errors
from trainer import gradcache
from trainer import replica_state
from trainer import run
from trainer import sources
from trainer.tasks import batch_losses

LOSSES = ("contrastive_pairs", "batch_hard_triplet", "histogram_chi_square")


def _config(task, replicas, mode="gradcache", **more):
  overrides = {"task": task, "accumulation.mode": mode, "accumulation.steps": 4,
               "optimizer.name": "adamw", "optimizer.weight_decay": 0.05,
               "optimizer.learning_rate": 0.01, "optimizer.global_clipnorm": 0.005,
               "optimizer.warmup_steps": 2, "train_steps": 3, "triplet.embedding_dim": 8,
               "histogram.train_examples": 512}
  if replicas == 2:
    overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
  overrides.update(more)
  return helpers.tiny_config(**overrides)


def _train(config, tmp_path, updates=3, task=None):
  strategy, trainer = helpers.build(config, tmp_path, task)
  initial, _ = helpers.snapshot(strategy, trainer)
  trainer.train(tf.constant(updates))
  weights, slots = helpers.snapshot(strategy, trainer)
  return trainer, initial, weights, slots


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("task", LOSSES)
def test_gradcache_equals_one_step_on_the_concatenated_batch(tmp_path, task, replicas):
  config = _config(task, replicas)
  trainer, initial, weights, slots = _train(config, tmp_path / "gradcache")
  assert int(trainer.optimizer.iterations.numpy()) == 3
  assert float(trainer.last_grad_norm.numpy()) > 0.005, "clipping must be active in this test"
  ref_weights, ref_slots = helpers.reference_run(config, initial,
                                                 helpers.update_batches(config, 3))
  assert helpers.max_abs_diff(weights, ref_weights) <= 1e-6
  assert helpers.max_abs_diff(slots, ref_slots) <= 1e-6
  # The seed's caveat, measured: averaging micro-batch gradients is another update.
  summed = _config(task, replicas, mode="sum")
  _, _, sum_weights, _ = _train(summed, tmp_path / "sum")
  assert helpers.max_abs_diff(sum_weights, ref_weights) > 1e-4


def test_one_all_gather_and_one_all_reduce_per_update(tmp_path):
  config = _config("contrastive_pairs", 2)
  strategy, trainer = helpers.build(config, tmp_path)
  iterator = iter(trainer.train_dataset)
  gathers = []
  original = tf.distribute.ReplicaContext.all_gather

  def counted(ctx, value, axis, options=None):
    gathers.append(len(tf.nest.flatten(value)))
    return original(ctx, value, axis, options)
  with collectives.AllReduceCounter() as counter, mock.patch.object(
      tf.distribute.ReplicaContext, "all_gather", counted):
    step = tf.function(trainer.train_step).get_concrete_function(iterator)
  assert (counter.calls, counter.tensors) == (1, 1)
  assert gathers == [1, 1], "one packed all_gather, called by each of the 2 replicas"
  graph_def = step.graph.as_graph_def()
  ops = [n.op for n in graph_def.node] + [n.op for f in graph_def.library.function
                                          for n in f.node_def]
  assert sum(op.startswith("CollectiveReduce") for op in ops) == 2  # One reduction, 2 devices.
  # TF's all_gather exchanges the shapes first, then the values: 2 ops per device.
  assert sum(op.startswith("CollectiveGather") for op in ops) == 4
  del strategy


class _DropoutPairs(batch_losses.ContrastivePairs):
  """InfoNCE through an MLP embedder with Dropout: the masks must match in both passes."""

  def build_model(self):
    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                             keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dropout(0.3), keras.layers.Dense(8)])


def _reference_with_masks(config, task, initial, batches, replicas):
  """One step per update on the concatenated batch, each (micro-step, replica) slice drawing
  the masks `gradcache.seeded` gives it."""
  model, optimizer = helpers.reference_model(config, task, initial)
  states = replica_state.seed_states(model)
  k, b = config.accumulation.steps, config.batch_size // replicas
  for update, batch in enumerate(batches):
    features = {n: t for n, t in batch.items() if n != sources.VALID_KEY}
    with tf.GradientTape() as tape:
      pieces = []
      for m in range(k):
        for r in range(replicas):
          start = m * config.batch_size + r * b
          gradcache.seeded(states, config.seed, update, m, r, replicas, k)
          pieces.append(task.represent(
              model, {n: t[start:start + b] for n, t in features.items()}, training=True))
      reps = {n: tf.concat([p[n] for p in pieces], 0) for n in pieces[0]}
      loss = base_task.batch_loss_of(task, reps, tf.ones([k * config.batch_size])).loss
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
  return [np.array(v) for v in model.trainable_variables]


def test_dropout_draws_the_same_masks_in_both_passes(tmp_path):
  config = _config("contrastive_pairs", 2)
  task = _DropoutPairs(config)
  trainer, initial, weights, _ = _train(config, tmp_path, task=task)
  batches = helpers.update_batches(config, 3, task)
  reference = _reference_with_masks(config, task, initial, batches, replicas=2)
  assert helpers.max_abs_diff(weights, reference) <= 1e-6
  # The masks matter: with other masks (another seed) the update is measurably different.
  other = _reference_with_masks(_with(config, seed=1), task, initial, batches, replicas=2)
  assert helpers.max_abs_diff(other, reference) > 1e-4


def _with(config, **changes):
  copy = config.copy_and_resolve_references()
  copy.update(changes)
  return copy


def test_gradcache_refuses_per_example_tasks_and_batchnorm(tmp_path):
  with pytest.raises(ValueError, match="needs a task with a batch-level loss"):
    helpers.build(helpers.tiny_config(**{"accumulation.mode": "gradcache"}), tmp_path / "a")
  with pytest.raises(ValueError, match="with trainable BatchNormalization"):
    helpers.build(helpers.tiny_config(**{"task": "contrastive_pairs", "model": "small_cnn_bn",
                                         "accumulation.mode": "gradcache"}), tmp_path / "b")


@pytest.mark.parametrize("mode", ["sum", "gradcache"])
def test_per_example_statistics_of_a_batch_level_loss_are_refused_in_both_modes(tmp_path, mode):
  """In `sum` mode they ran and logged gns -32, mean_norm 0 on every update (a probe's own
  InfoNCE task); gradcache's refusal advised `sum`."""
  config = helpers.tiny_config(**{"task": "contrastive_pairs", "accumulation.mode": mode,
                                  "accumulation.steps": 2, "per_example.every_steps": 1})
  with pytest.raises(errors.ConfigError, match=r"^`per_example.every_steps`=1: \w+ has a "
                     r"batch-level loss \(base_task.BatchLossTask\), whose per-example "
                     r"gradients are undefined; set it to 0$"):
    helpers.build(config, tmp_path)


def test_batch_hard_triplet_recipe_trains_from_the_cli_and_resumes_bitwise(tmp_path):
  recipe = "configs/triplet_vgg.py:batch_hard,smoke,synthetic"
  common = ("deterministic=True", "steps_per_loop=2", "checkpoint_every=2", "mode=train",
            "export_at_end=False")
  full, _ = helpers.assert_resume_is_bitwise(tmp_path, recipe, *common, train_steps=4)
  assert "triplet_accuracy" in full.stderr


class _PositionWeighted(batch_losses.HistogramChiSquare):
  """A loss that weighs each row by its place: exact only if the gathered representations
  arrive in stream order (micro-step-major, then replica), as the one-device batch has them."""

  def batch_loss(self, representations, valid):
    y = representations["y"]
    place = tf.range(1, tf.shape(y)[0] + 1, dtype=tf.float32)
    return base_task.BatchLossOutput(loss=tf.reduce_sum(place * tf.square(y) * valid) / 100.0)


def test_gathered_representations_keep_the_stream_order(tmp_path):
  config = _config("histogram_chi_square", 2)
  task = _PositionWeighted(config)
  _, initial, weights, _ = _train(config, tmp_path, task=task)
  ref_weights, _ = helpers.reference_run(config, initial,
                                         helpers.update_batches(config, 3, task), task)
  assert helpers.max_abs_diff(weights, ref_weights) <= 1e-6


@pytest.mark.parametrize("task,metric", [("contrastive_pairs", "pair_accuracy"),
                                         ("batch_hard_triplet", "triplet_accuracy")])
def test_a_batch_loss_evaluates_the_same_on_one_and_two_replicas(tmp_path, task, metric):
  # Each replica's half of the evaluation batch was its own batch (a probe, 2026-12-07: loss
  # 4.69 on one device, 4.00 on two, the loss of batches half as large). The triplet task's
  # representations carry int64 labels beside the float embeddings.
  def config(**more):
    return helpers.tiny_config(**{"task": task, "accumulation.mode": "gradcache",
                                  "train_steps": 2, "triplet.embedding_dim": 8, **more})
  run.run(config(mode="train"), str(tmp_path))
  one = run.run(config(mode="eval"), str(tmp_path))["eval"]
  two = run.run(config(mode="eval", strategy="mirrored", cpu_replicas=2), str(tmp_path))["eval"]
  assert one["examples"] == two["examples"] == 64
  for name in ("loss", metric):
    assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-6), name


def test_gradcache_reads_more_than_32_micro_batches_in_one_update(tmp_path):
  # TensorFlow refuses a 33rd graph-mode `get_next` traced with AutoGraph off (it suspects a
  # Python loop); gradcache reads k micro-batches per update on purpose (the triplet recipe:
  # k = 128). Found by a review, 2026-12-07.
  config = _config("contrastive_pairs", 1, **{"accumulation.steps": 40, "batch_size": 4,
                                              "train_steps": 1})
  trainer, _, _, _ = _train(config, tmp_path, updates=1)
  assert int(trainer.micro_batches_seen.numpy()) == 40
