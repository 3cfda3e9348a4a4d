"""Where accumulation communicates, what it keeps local, and how it skips (issue 3)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import example_tasks
import helpers
from trainer import base_task
from trainer import collectives
from trainer import data
from trainer import run as run_lib


def _mirrored_config(**overrides):
  base = {"accumulation.steps": 4, "strategy": "mirrored", "cpu_replicas": 2}
  base.update(overrides)
  return helpers.tiny_config(**base)


def test_micro_steps_stay_local(tmp_path):
  """Each replica's buffer holds its own gradient sum; weights and slots are untouched."""
  config = _mirrored_config()
  strategy, trainer = helpers.build(config, tmp_path)
  iterator = iter(trainer.train_dataset)
  micro = tf.function(lambda it: strategy.run(trainer.micro_step, args=(next(it),)))
  weights, slots = helpers.snapshot(strategy, trainer)
  for _ in range(3):
    micro(iterator)
  grad_buffers, scalar_buffers = trainer.buffers.local_values(strategy)
  # Expected: replica r summed positions [g*16 + r*8, g*16 + r*8 + 8) for g = 0, 1, 2.
  source = helpers.train_source(config)
  for replica in range(2):
    grads, scalars = None, None
    for g in range(3):
      start = g * 16 + replica * 8
      batch = data.batch_at(source, tf.range(start, start + 8, dtype=tf.int64),
                            seed=config.seed, shuffle=config.data.shuffle)
      local_grads, local_scalars, _ = trainer.local_sums(batch)
      grads = local_grads if grads is None else [a + b for a, b in zip(grads, local_grads)]
      scalars = local_scalars if scalars is None else scalars + local_scalars
    for buffer, expected in zip(grad_buffers, grads):
      np.testing.assert_allclose(buffer[replica], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scalar_buffers[replica], scalars, rtol=1e-5)
  assert not np.allclose(grad_buffers[0][0], grad_buffers[0][1]), "replicas saw different data"
  after_weights, after_slots = helpers.snapshot(strategy, trainer)
  assert all(np.array_equal(a, b) for a, b in zip(weights, after_weights))
  assert all(np.array_equal(a, b) for a, b in zip(slots, after_slots))
  assert int(trainer.optimizer.iterations.numpy()) == 0


def test_one_packed_all_reduce_per_update(tmp_path):
  config = _mirrored_config()
  strategy, trainer = helpers.build(config, tmp_path)
  iterator = iter(trainer.train_dataset)
  with collectives.AllReduceCounter() as micro_count:
    micro = tf.function(lambda it: strategy.run(trainer.micro_step, args=(next(it),))
                        ).get_concrete_function(iterator)
  assert (micro_count.calls, collectives.collective_reduce_ops(micro)) == (0, 0)
  with collectives.AllReduceCounter() as update_count:
    step = tf.function(trainer.train_step).get_concrete_function(iterator)
  assert (update_count.calls, update_count.tensors) == (1, 1), "one all-reduce, one packed tensor"
  # MirroredStrategy on 2 CPUs emits one CollectiveReduce op per device for that one reduction.
  assert collectives.collective_reduce_ops(step) == 2


def test_overflow_on_one_replica_skips_the_whole_update(tmp_path):
  """An Inf in micro-step 2 on replica 1 only: no replica applies, the loss scale halves once."""
  config = _mirrored_config(**{"mixed_precision": "mixed_float16", "train_steps": 2,
                               "optimizer.name": "adam"})
  source = helpers.train_source(config)

  def poisoned(ids, positions):
    batch = source.take(ids, positions)
    # Update 0 = positions [0, 64); micro-step 2 = [32, 48); replica 1 owns [40, 48).
    bad = tf.logical_and(positions >= 40, positions < 48)
    image = tf.where(bad[:, None, None, None], tf.constant(np.inf, batch["image"].dtype),
                     batch["image"])
    return dict(batch, image=image)

  strategy, trainer = helpers.build(config, tmp_path)
  trainer.train_dataset = run_lib._train_dataset(  # pylint: disable=protected-access
      config, strategy, base_task.ExampleSource(source.num_examples, poisoned), 0)
  weights, slots = helpers.snapshot(strategy, trainer)
  scale = float(trainer.loss_scale.numpy())
  trainer.train(tf.constant(1))
  after_weights, after_slots = helpers.snapshot(strategy, trainer)
  assert int(trainer.skipped_updates.numpy()) == 1
  assert int(trainer.optimizer.iterations.numpy()) == 0
  assert float(trainer.loss_scale.numpy()) == scale / 2
  assert all(np.array_equal(a, b) for a, b in zip(weights, after_weights))
  assert all(np.array_equal(a, b) for a, b in zip(slots, after_slots))
  grad_buffers, _ = trainer.buffers.local_values(strategy)
  assert all(not np.any(b) for per_var in grad_buffers for b in per_var), "cycle discarded"
  trainer.train(tf.constant(1))  # The next update is clean and applies on both replicas.
  assert int(trainer.optimizer.iterations.numpy()) == 1
  assert float(trainer.loss_scale.numpy()) == scale / 2
  for var in trainer.model.trainable_variables:
    copies = helpers.local_values(strategy, var)
    assert np.array_equal(copies[0], copies[1])
  assert not np.array_equal(helpers.snapshot(strategy, trainer)[0][0], weights[0])


def test_batchnorm_with_accumulation_needs_an_explicit_choice(tmp_path):
  config = helpers.tiny_config(**{"model": "small_cnn_bn", "accumulation.steps": 2})
  try:
    helpers.build(config, tmp_path)
  except ValueError as e:
    assert "accumulation.batchnorm" in str(e) and "per_micro_batch" in str(e)
  else:
    raise AssertionError("BatchNorm with k>1 must not pass silently")
  config.accumulation.batchnorm = "per_micro_batch"
  _, trainer = helpers.build(config, tmp_path / "ok")
  trainer.train(tf.constant(1))
  assert int(trainer.optimizer.iterations.numpy()) == 1


def _replica_copies_differ(strategy, model):
  return [v.path for v in model.weights
          if not all(np.array_equal(c, helpers.local_values(strategy, v)[0])
                     for c in helpers.local_values(strategy, v)[1:])]


@pytest.mark.parametrize("k", [1, 4])
def test_batchnorm_statistics_stay_identical_across_replicas(tmp_path, k):
  """Moving statistics ride in the update's one all-reduce and are averaged on every replica."""
  config = _mirrored_config(**{"model": "small_cnn_bn", "accumulation.steps": k,
                               "accumulation.batchnorm": "per_micro_batch", "train_steps": 3})
  strategy, trainer = helpers.build(config, tmp_path)
  iterator = iter(trainer.train_dataset)
  with collectives.AllReduceCounter() as counter:
    step = tf.function(trainer.train_step).get_concrete_function(iterator)
  assert (counter.calls, counter.tensors) == (1, 1)
  assert collectives.collective_reduce_ops(step) == 2  # One reduction, one op per device.
  synced = {v.path for v in trainer._state.variables}  # pylint: disable=protected-access
  assert synced == {v.path for v in trainer.model.non_trainable_variables
                    if "moving" in v.path}, synced
  trainer.train(tf.constant(3))
  assert _replica_copies_differ(strategy, trainer.model) == []
  # The statistics moved, and both replicas' batches shaped them.
  moving_mean = [v for v in trainer.model.non_trainable_variables if "moving_mean" in v.path][0]
  assert np.abs(helpers.local_values(strategy, moving_mean)[0]).max() > 0


def test_batchnorm_statistics_drift_apart_when_left_local(tmp_path):
  """`replica_state=local` is Keras' own behaviour: each replica keeps its own statistics."""
  config = _mirrored_config(**{"model": "small_cnn_bn", "accumulation.steps": 1,
                               "replica_state": "local", "train_steps": 3})
  strategy, trainer = helpers.build(config, tmp_path)
  trainer.train(tf.constant(3))
  differ = _replica_copies_differ(strategy, trainer.model)
  assert differ and all("moving" in path for path in differ), differ


class _Counting(keras.layers.Layer):
  """Counts its training calls in a float variable and the examples seen in an int one."""

  def build(self, input_shape):
    self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")
    self.seen = self.add_weight(shape=(), initializer="zeros", dtype="int32", trainable=False,
                                name="seen")

  def call(self, x, training=None):
    if training:
      self.calls.assign_add(1.0)
      self.seen.assign_add(tf.shape(x)[0])
    return x


class _CountingTask(example_tasks.NoMetrics):
  def build_model(self):
    inputs = keras.Input((12,))
    return keras.Model(inputs, keras.layers.Dense(2)(_Counting(name="counting")(inputs)))


def test_integer_state_is_kept_per_replica_and_named(tmp_path, caplog):
  """Float state is averaged; an int counter is not (each replica keeps its own) and the first
  loop's warning names it beside the float one (it named only floats)."""
  config = _mirrored_config(**{"accumulation.steps": 2, "train_steps": 2})
  strategy, trainer = helpers.build(config, tmp_path, _CountingTask(config))
  with caplog.at_level("WARNING"):
    trainer.train(tf.constant(2))
  layer = trainer.model.get_layer("counting")
  assert helpers.local_values(strategy, layer.calls) == [4.0, 4.0]  # 2 updates x k=2, averaged.
  assert helpers.local_values(strategy, layer.seen) == [32, 32]  # 4 micro-batches of 8, each.
  assert "writes the integer state counting/seen, which is not averaged" in caplog.text
  assert "writes counting/calls, counting/seen once per micro-step" in caplog.text


def test_dropout_seed_state_is_not_named_as_state_written_per_micro_step(tmp_path, caplog):
  """Dropout's seed generator writes its state on every forward: that is how each micro-step
  draws new masks, not a running statistic. Every Dropout model with k > 1 was warned that it
  moves k times per update, and under Mirrored that it is integer state not averaged."""
  config = _mirrored_config(**{"accumulation.steps": 2, "train_steps": 1})
  strategy, trainer = helpers.build(config, tmp_path, example_tasks.WithDropout(config))
  with caplog.at_level("WARNING"):
    trainer.train(tf.constant(1))
  assert int(trainer.optimizer.iterations.numpy()) == 1
  assert "once per micro-step" not in caplog.text and "integer state" not in caplog.text, (
      caplog.text)


def test_frozen_weights_are_not_averaged(tmp_path):
  """Only variables the forward pass writes are synchronised: frozen weights keep their bits."""
  config = _mirrored_config(**{"model": "small_cnn_bn", "accumulation.steps": 1})
  strategy, trainer = helpers.build(config, tmp_path)
  frozen = trainer.model.layers[0]
  frozen.trainable = False  # Its kernel becomes non-trainable, but nothing writes it.
  assert trainer._state.variables == []  # pylint: disable=protected-access
  trainer._state = trainer._state.__class__(trainer.model)  # pylint: disable=protected-access
  trainer.train(tf.constant(1))
  synced = {v.path for v in trainer._state.variables}  # pylint: disable=protected-access
  assert frozen.kernel.path not in synced and synced, synced


def test_mixed_float16_does_not_depend_on_k_or_the_replicas(tmp_path):
  """The loss scale multiplies the mean over an update's examples, as Keras does: each example's
  float16 gradient is the same size for k = 1 x B = 32, k = 4 x b = 8 and two replicas. (It
  multiplied the sum: 32x larger rows that overflowed, so the three skipped different updates
  and ended 1e-2 apart.) Equal to float16 rounding, with no skipped update."""
  base = {"mixed_precision": "mixed_float16", "train_steps": 6, "steps_per_loop": 6,
          "checkpoint_every": 6, "mode": "train", "optimizer.name": "sgd",
          "optimizer.learning_rate": 0.1}
  setups = {"k1": {"batch_size": 32},
            "k4": {"batch_size": 8, "accumulation.steps": 4},
            "mirrored": {"batch_size": 32, "strategy": "mirrored", "cpu_replicas": 2}}
  weights = {}
  for name, overrides in setups.items():
    result = run_lib.run(helpers.tiny_config(**dict(base, **overrides)), str(tmp_path / name))
    assert result["skipped_updates"] == 0, name
    weights[name] = helpers.checkpoint_weights(tmp_path / name)[1]
  # 1e-3: on an Intel Xeon (2026-12-05) k4 ended up to 4.7e-4 from k1 after 6 updates, nearly all
  # in one output column (likely float16 rounding of 8- against 32-row matmuls; not confirmed).
  # The bug this guards was 1e-2.
  for name in ("k4", "mirrored"):
    for key, value in weights["k1"].items():
      np.testing.assert_allclose(weights[name][key], value, atol=1e-3, err_msg=f"{name} {key}")


def test_write_watchers_may_close_in_any_order():
  """Replicas trace in threads that interleave at a merge_call, so a first watcher may close
  while a second is open. Each context restored what it found: closing out of order left a
  stale patch on keras.Variable.assign for good (a review, 2026-12-07)."""
  from trainer import replica_state  # pylint: disable=g-import-not-at-top
  unpatched = keras.Variable.__dict__.get("assign")
  a, b = keras.Variable(0.0), keras.Variable(0.0)
  first = replica_state.writes_to({id(a)})
  second = replica_state.writes_to({id(a), id(b)})
  seen_first, seen_second = first.__enter__(), second.__enter__()
  a.assign(1.0)
  first.__exit__(None, None, None)  # Out of order: the first closes while the second is open.
  b.assign(2.0)
  second.__exit__(None, None, None)
  assert seen_first == {id(a)} and seen_second == {id(a), id(b)}
  assert keras.Variable.__dict__.get("assign") is unpatched
  assert (float(a.numpy()), float(b.numpy())) == (1.0, 2.0)
