"""Gradient accumulation equals the large batch: weights, slots and iterations (issue 3)."""
import numpy as np
import pytest
import tensorflow as tf

import example_tasks
import helpers
from trainer import base_task

OPTIMIZERS = {
    "sgd_momentum": {"optimizer.name": "sgd", "optimizer.momentum": 0.9,
                     "optimizer.learning_rate": 0.1},
    "adamw": {"optimizer.name": "adamw", "optimizer.weight_decay": 0.05,
              "optimizer.learning_rate": 0.01},
}


@pytest.mark.parametrize("xla", ["off", "on"])
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_accumulation_equals_large_batch(tmp_path, opt, k, replicas, xla):
  overrides = dict(OPTIMIZERS[opt])
  overrides.update({"accumulation.steps": k, "optimizer.global_clipnorm": 0.3,
                    "optimizer.warmup_steps": 2, "optimizer.decay": "cosine", "train_steps": 3,
                    "xla": xla})
  if replicas == 2:
    overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
  config = helpers.tiny_config(**overrides)
  strategy, trainer = helpers.build(config, tmp_path)
  initial, _ = helpers.snapshot(strategy, trainer)
  trainer.train(tf.constant(3))
  weights, slots = helpers.snapshot(strategy, trainer)
  ref_weights, ref_slots = helpers.reference_run(config, initial,
                                                 helpers.update_batches(config, 3))
  assert float(trainer.last_grad_norm.numpy()) > 0.3, "clipping must be active in this test"
  assert int(trainer.optimizer.iterations.numpy()) == 3
  assert int(trainer.global_step.numpy()) == 3
  assert int(trainer.micro_batches_seen.numpy()) == 3 * k
  assert trainer.xla.enabled == (xla == "on")
  tolerance = 1e-6 if xla == "off" else 1e-5  # XLA fuses and reorders float32 arithmetic.
  assert helpers.max_abs_diff(weights, ref_weights) <= tolerance
  assert len(slots) == len(ref_slots)
  assert helpers.max_abs_diff(slots, ref_slots) <= tolerance
  for var in trainer.model.trainable_variables:  # Replicas stay identical.
    copies = helpers.local_values(strategy, var)
    assert all(np.array_equal(copies[0], c) for c in copies[1:])


def test_k1_uses_no_buffers(tmp_path):
  """k=1 IS the plain step: one batch's sums go straight to the update, no buffers exist.

  (Its exactness against the big-batch reference is covered by the parametrized test above.)
  """
  config = helpers.tiny_config(**{"accumulation.steps": 1})
  _, trainer = helpers.build(config, tmp_path)
  assert trainer.buffers is None
  trainer.train(tf.constant(2))
  assert int(trainer.optimizer.iterations.numpy()) == 2
  assert int(trainer.micro_batches_seen.numpy()) == 2


def _masked(positions):
  # Between 2 and 6 valid examples of 8 per replica and micro-step, all different.
  keep = (positions * 37 + positions // 5) % 9 < 2 + (positions // 8) % 5
  return tf.cast(keep, tf.float32)


def test_mean_of_means_would_fail_masked_counts(tmp_path):
  """Different valid counts per micro-step and replica still give ∇(Σloss/Σcount)."""
  config = helpers.tiny_config(**{"accumulation.steps": 4, "strategy": "mirrored",
                                  "cpu_replicas": 2, "optimizer.name": "sgd",
                                  "optimizer.learning_rate": 0.5, "train_steps": 2})
  task = helpers.WithBatchWeights(config, _masked)
  strategy, trainer = helpers.build(config, tmp_path, task)
  initial, _ = helpers.snapshot(strategy, trainer)
  trainer.train(tf.constant(2))
  weights, _ = helpers.snapshot(strategy, trainer)
  batches = helpers.update_batches(config, 2, task)
  counts = [np.array(b["weight"]).reshape(4, 2, 8).sum(-1) for b in batches]
  assert len({float(c) for c in counts[0].ravel()}) > 2, "counts must differ across micro-steps"
  ref_weights, _ = helpers.reference_run(config, initial, batches, task)
  assert helpers.max_abs_diff(weights, ref_weights) <= 1e-6
  # The mean of per-micro-batch means is measurably different on these masks.
  mean_of_means = _mean_of_means_weights(config, initial, batches, task)
  assert helpers.max_abs_diff(mean_of_means, ref_weights) > 1e-4


def _mean_of_means_weights(config, initial, batches, task):
  model = task.build_model()
  for var, value in zip(model.trainable_variables, initial):
    var.assign(value)
  k, b = config.accumulation.steps, config.batch_size
  for batch in batches:
    grads = None
    for i in range(k):
      micro = {key: value[i * b:(i + 1) * b] for key, value in batch.items()}
      with tf.GradientTape() as tape:
        loss, weight, _ = base_task.weighted_outputs(task, model, micro, training=True)
        loss = tf.reduce_sum(loss * weight) / tf.maximum(tf.reduce_sum(weight), 1.0)
      g = tape.gradient(loss, model.trainable_variables)
      grads = g if grads is None else [x + y for x, y in zip(grads, g)]
    for var, g in zip(model.trainable_variables, grads):
      var.assign_sub(config.optimizer.learning_rate * g / k)
  return [np.array(v) for v in model.trainable_variables]


@pytest.mark.parametrize("model", ["mlp", "small_cnn"])
def test_exact_with_per_example_statistics_on_every_update(tmp_path, model):
  """With statistics on every update, the recorded layers' gradients are the sums of their
  per-example terms (no second kernel gradient): still the big batch's update."""
  # SGD without clipping: a wrong gradient scale shows in the weights (Adam or clipping would
  # normalise it away).
  overrides = dict(OPTIMIZERS["sgd_momentum"])
  overrides.update({"model": model, "accumulation.steps": 4, "strategy": "mirrored",
                    "cpu_replicas": 2, "optimizer.warmup_steps": 2,
                    "per_example.every_steps": 1, "train_steps": 3})
  config = helpers.tiny_config(**overrides)
  strategy, trainer = helpers.build(config, tmp_path)
  initial, _ = helpers.snapshot(strategy, trainer)
  trainer.train(tf.constant(3))
  assert trainer.gradients_from_statistics_traced, "the fast path ran"
  weights, slots = helpers.snapshot(strategy, trainer)
  ref_weights, ref_slots = helpers.reference_run(config, initial,
                                                 helpers.update_batches(config, 3))
  assert helpers.max_abs_diff(weights, ref_weights) <= 1e-6
  assert helpers.max_abs_diff(slots, ref_slots) <= 1e-6


def test_tied_weights_take_the_tape_gradient_with_statistics_on(tmp_path):
  """An output projection that reuses the embedding matrix reads it outside the Embedding's
  call: its per-example terms miss that use, so the Embedding takes the general path, whose
  update gradient comes from the tape; the other layers' still come from their terms."""
  config = helpers.tiny_config(**dict(OPTIMIZERS["sgd_momentum"], **{
      "accumulation.steps": 2, "per_example.every_steps": 1, "train_steps": 2}))
  task = example_tasks.TiedEmbeddings(config)
  strategy, trainer = helpers.build(config, tmp_path, task)
  initial, _ = helpers.snapshot(strategy, trainer)
  trainer.train(tf.constant(2))
  assert trainer.gradients_from_statistics_traced
  assert [id(v) for v in trainer.statistics.recorder.general_variables] == [
      id(task.model_embedding(trainer.model).embeddings)]
  weights, _ = helpers.snapshot(strategy, trainer)
  ref_weights, _ = helpers.reference_run(config, initial, helpers.update_batches(config, 2, task),
                                         task)
  assert helpers.max_abs_diff(weights, ref_weights) <= 1e-6
