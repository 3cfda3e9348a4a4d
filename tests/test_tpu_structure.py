"""Every replica function microstep hands to `strategy.run` traces inside TPU's `tpu.replicate`.

A TPUStrategy over fake cores (tests/cpu_tpu.py) builds the same graph a TPU would compile, on a
CPU. Traced, never run. The two failures of the old cross-replica apply are reproduced on the same
strategy: a dataclass returned from `strategy.run`, and Keras' update on packed TPU variables.
"""
import dataclasses

import pytest
import tensorflow as tf

import cpu_tpu
import helpers
from trainer import data
from trainer import optimizers
from trainer import orbit_trainer
from trainer import tasks
from trainer import update_statistics


def _tpu_trainer(**overrides):
  config = helpers.tiny_config(**overrides)
  strategy = cpu_tpu.cpu_tpu_strategy(2)
  task = tasks.create_task(config)
  with strategy.scope():
    model = task.build_model()
    optimizer = optimizers.create_optimizer(config.optimizer, config.train_steps)
  trainer = orbit_trainer.Trainer(config=config, strategy=strategy, task=task, model=model,
                                  optimizer=optimizer, train_dataset=None)
  batch = data.batch_at(helpers.train_source(config, task), tf.range(8, dtype=tf.int64),
                        seed=0, shuffle=True)
  return strategy, trainer, tf.nest.map_structure(tf.TensorSpec.from_tensor, batch)


def _trace(strategy, replica_fn, spec):
  def replicated_step(batch):  # A named function: TPU scopes refuse "<lambda>".
    return strategy.run(replica_fn, args=(batch,))
  return tf.function(replicated_step).get_concrete_function(spec)


def _op_types(graph):
  return {op.type for op in graph.get_operations()}


def test_micro_step_traces_inside_tpu_replicate():
  strategy, trainer, spec = _tpu_trainer(**{"accumulation.steps": 4})
  graph = _trace(strategy, trainer._micro_step_fn, spec).graph  # pylint: disable=protected-access
  assert "TPUReplicateMetadata" in _op_types(graph)
  inside, outside = cpu_tpu.replicated_write_ops(graph)
  assert len(inside) >= len(trainer.model.trainable_variables), "buffer adds inside the cluster"
  assert outside == []


@pytest.mark.parametrize("k,model", [(1, "mlp"), (4, "mlp"), (1, "small_cnn_bn")])
def test_update_step_and_its_apply_trace_inside_tpu_replicate(k, model):
  strategy, trainer, spec = _tpu_trainer(**{"accumulation.steps": k, "model": model,
                                            "optimizer.name": "adamw",
                                            "optimizer.global_clipnorm": 1.0})
  function = _trace(strategy, trainer._update_step_fn, spec)  # pylint: disable=protected-access
  assert "TPUReplicateMetadata" in _op_types(function.graph)
  outputs = [strategy.experimental_local_results(o)[0] for o in function.structured_outputs]
  scalars, grad_norm, applied = outputs  # Tensors only.
  assert scalars.shape == [2 + len(trainer.task.metric_names)]
  assert grad_norm.shape == [] and applied.dtype == tf.bool
  inside, outside = cpu_tpu.replicated_write_ops(function.graph)
  assert outside == [], f"writes outside the replicated program: {outside[:5]}"
  # Adam(W) writes weights, two moments per variable and the iteration count, all inside.
  assert len(inside) >= 3 * len(trainer.model.trainable_variables) + 1


@pytest.mark.parametrize("every,k", [(1, 1), (3, 2)])
def test_per_example_statistics_in_the_update_trace_inside_tpu_replicate(every, k):
  """The statistics live in the micro-step and update step themselves (ghost path, all_gather)."""
  strategy, trainer, spec = _tpu_trainer(**{"model": "small_cnn", "accumulation.steps": k,
                                            "per_example.every_steps": every})
  if k > 1:
    micro = _trace(strategy, trainer._micro_step_fn, spec)  # pylint: disable=protected-access
    assert "TPUReplicateMetadata" in _op_types(micro.graph)
  function = _trace(strategy, trainer._update_step_fn, spec)  # pylint: disable=protected-access
  assert "TPUReplicateMetadata" in _op_types(function.graph)
  outputs = [strategy.experimental_local_results(o)[0] for o in function.structured_outputs]
  assert len(outputs) == 5
  statistics, gathered = outputs[3], outputs[4]
  assert statistics.shape == [len(update_statistics.SCALARS) - 1]
  assert gathered.shape == [16, 3]  # 8 examples on each of the 2 replicas, gathered.
  assert cpu_tpu.replicated_write_ops(function.graph)[1] == []


def test_old_path_fails_on_tpu_dataclass_outputs():
  """(a) The old reduce step returned a dataclass from strategy.run; tpu.replicate refuses it."""
  strategy, trainer, spec = _tpu_trainer()

  @dataclasses.dataclass
  class Reduced:
    grads: list

  def old_reduce_step(batch):
    return Reduced(grads=trainer.local_sums(batch)[0])

  with pytest.raises(Exception, match="TPU function return values must all either be"):
    _trace(strategy, old_reduce_step, spec)


def test_old_path_fails_on_packed_tpu_variables():
  """(b) Applying in cross-replica context updates the PACKED variable; Keras finds no slots."""
  strategy, trainer, spec = _tpu_trainer(**{"optimizer.name": "adam"})
  variables = trainer.model.trainable_variables

  def replica_grads(batch):
    return trainer.local_sums(batch)[0]

  def old_update(batch):
    per_replica = strategy.run(replica_grads, args=(batch,))
    grads = [strategy.experimental_local_results(g)[0] for g in per_replica]
    trainer.optimizer.apply(grads, variables)
  with pytest.raises(KeyError):
    tf.function(old_update).get_concrete_function(spec)


def test_gradcache_update_traces_inside_tpu_replicate():
  """Both passes, the all_gather of the representations and the apply: one replicated program."""
  strategy, trainer, spec = _tpu_trainer(**{"task": "contrastive_pairs", "accumulation.steps": 2,
                                            "accumulation.mode": "gradcache",
                                            "triplet.embedding_dim": 8})
  def replicated_step(first, second):
    return strategy.run(trainer._update_step_fn, args=(first, second))  # pylint: disable=protected-access
  function = tf.function(replicated_step).get_concrete_function(spec, spec)
  assert "TPUReplicateMetadata" in _op_types(function.graph)
  inside, outside = cpu_tpu.replicated_write_ops(function.graph)
  assert outside == [] and len(inside) >= 3 * len(trainer.model.trainable_variables)
