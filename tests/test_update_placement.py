"""The update runs in replica context: each device applies its own copy, nothing big is copied.

Before this, the update was applied in cross-replica context from replica 0's gradient, which
MirroredStrategy copied to every other device each update ((R-1)·4·P bytes). The partition-graph
count below reads what TensorFlow actually sends between devices.
"""
import json
import os
import subprocess
import sys
from unittest import mock

import keras
import pytest
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib

import helpers
from trainer import collectives
from trainer import optimizers
from trainer import strategies
from trainer.bench import placement

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_gradient_bytes_cross_devices_with_2_and_3_replicas(tmp_path):
  out = tmp_path / "placement.json"
  done = subprocess.run(
      ["timeout", "-k", "5", "300", sys.executable, "-m", "trainer.bench", "placement",
       "--replicas=2,3", "--k=4", f"--json={out}"], cwd=REPO, capture_output=True, text=True,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), timeout=320, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert [r["replicas"] for r in rows] == [2, 3]
  for row in rows:
    assert row["unknown_transfers"] == [], row
    assert row["gradient_bytes_across_devices"] == 0, row
    assert row["largest_transfer_bytes"] < placement.SCALAR_LIMIT_BYTES, row
    assert row["transfers"] > 0, "the flags and counters do cross: the measurement sees them"


def test_the_measurement_sees_a_gradient_broadcast():
  """The old way (apply replica 0's gradient in cross-replica context) shows up as (R-1)·4·P."""
  strategy = strategies.mirrored_strategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32), keras.layers.Dense(32)])
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
  x = tf.random.stateless_normal((4, 8), seed=[1, 2])

  def replica_grads(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(x) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    return tf.distribute.get_replica_context().all_reduce("sum", grads)

  def old_update(x):
    grads = strategy.run(replica_grads, args=(x,))
    grads = [strategy.experimental_local_results(g)[0] for g in grads]
    optimizer.apply(grads, model.trainable_variables)  # Cross-replica, outside the scope.

  transfers = collectives.device_transfers(old_update, x)
  params = sum(int(tf.size(v)) for v in model.trainable_variables)
  row = placement.summarize(transfers, 4 * params)
  # Every bias has 32 floats (>= 100 bytes); the input x (128 bytes) is sent to replica 1 too.
  assert row["gradient_bytes_across_devices"] == 4 * params + x.shape.num_elements() * 4


def _record_contexts(trainer, strategy):
  """Traces one update; returns (apply calls, optimizer variable writes) with their contexts."""
  applies, writes = [], []
  optimizer_cls = type(trainer.optimizer)
  original_apply = optimizer_cls.apply

  def apply(self, grads, variables=None):
    ctx = tf.distribute.get_replica_context()
    applies.append((tf.distribute.in_cross_replica_context(),
                    None if ctx is None else int(tf.get_static_value(ctx.replica_id_in_sync_group)),
                    ctx is not None and ctx.strategy is strategy))
    return original_apply(self, grads, variables)

  def recording(name):
    original = getattr(optimizer_cls, name)

    def write(self, variable, value):
      writes.append((name, tf.distribute.in_cross_replica_context(),
                     distribute_lib.get_update_replica_id()))
      return original(self, variable, value)
    return write

  patches = [mock.patch.object(optimizer_cls, "apply", apply)] + [
      mock.patch.object(optimizer_cls, n, recording(n))
      for n in ("assign", "assign_add", "assign_sub")]
  for p in patches:
    p.start()
  try:
    tf.function(trainer.train_step).get_concrete_function(iter(trainer.train_dataset))
  finally:
    for p in reversed(patches):
      p.stop()
  return applies, writes


@pytest.mark.parametrize("replicas", [1, 2])
def test_every_optimizer_write_happens_per_replica_inside_strategy_run(tmp_path, replicas):
  overrides = {"accumulation.steps": 2, "optimizer.name": "adamw"}
  if replicas == 2:
    overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
  strategy, trainer = helpers.build(helpers.tiny_config(**overrides), tmp_path)
  applies, writes = _record_contexts(trainer, strategy)
  # apply is entered once per replica, in that replica's context, inside strategy.run.
  assert sorted(applies) == [(False, r, True) for r in range(replicas)]
  assert writes, "the optimizer writes its variables"
  for name, cross_replica, update_replica in writes:
    # Each write is in a replica context or in TF's per-device update of one replica's copy.
    assert not cross_replica or update_replica is not None, (name, cross_replica, update_replica)


def test_keras_would_reduce_twice_without_the_skip(tmp_path):
  """The Keras hook matters: left alone, Keras all-reduces the already reduced gradient."""
  config = helpers.tiny_config(**{"strategy": "mirrored", "cpu_replicas": 2,
                                  "accumulation.steps": 2})
  with mock.patch.object(optimizers, "skip_keras_all_reduce", lambda opt: opt), \
       mock.patch.object(optimizers, "check_keras_all_reduce_skipped", lambda opt: None):
    _, trainer = helpers.build(config, tmp_path)
    with collectives.AllReduceCounter() as counter:
      tf.function(trainer.train_step).get_concrete_function(iter(trainer.train_dataset))
  assert counter.calls == 2


def test_a_keras_without_the_hook_fails_loudly():
  class NoHook:
    pass
  with pytest.raises(optimizers.KerasInternalsChanged, match="_all_reduce_sum_gradients"):
    optimizers.skip_keras_all_reduce(NoHook())
  optimizer = optimizers.skip_keras_all_reduce(keras.optimizers.SGD(0.1))
  with pytest.raises(optimizers.KerasInternalsChanged, match="without calling"):
    optimizers.check_keras_all_reduce_skipped(optimizer)
