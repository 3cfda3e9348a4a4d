"""Shared test helpers: tiny configs, a trainer built by the real `run.build`, and the reference.

The reference is the thing accumulation must equal: a plain Keras optimizer on ONE device, fed
the concatenated batch of an update (k micro-batches x all replicas), with Keras' own
`global_clipnorm` (correct on one device) and loss Σ w·l / Σ w.
"""
import numpy as np
import tensorflow as tf

from trainer import config_defaults
from trainer import optimizers
from trainer import run
from trainer import tasks


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
  config.optimizer.learning_rate = 0.05
  for key, value in overrides.items():
    node = config
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return config


def build(config, workdir):
  """Strategy and trainer from the real builder (no Controller)."""
  strategy, trainer, _, _, _ = run.build(config, str(workdir))
  return strategy, trainer


def local_values(strategy, variable):
  value = getattr(variable, "value", variable)
  return [np.array(v) for v in strategy.experimental_local_results(value)]


def snapshot(strategy, trainer):
  """First-replica numpy copies of weights, optimizer variables (slots, iterations)."""
  weights = [local_values(strategy, v)[0] for v in trainer.model.trainable_variables]
  slots = [local_values(strategy, v)[0] for v in trainer.optimizer.variables]
  return weights, slots


def update_batches(config, num_updates, make_batch=None):
  """The concatenated batch of each update: stream positions [u*k*B, (u+1)*k*B)."""
  task = tasks.create_task(config)
  make_batch = make_batch or task.batch_fn("train")
  per_update = config.accumulation.steps * config.batch_size
  return [make_batch(tf.range(u * per_update, (u + 1) * per_update, dtype=tf.int64))
          for u in range(num_updates)]


def reference_run(config, initial_weights, batches):
  """Plain single-device updates on whole batches; returns (weights, optimizer variables)."""
  task = tasks.create_task(config)
  model = task.build_model()
  for var, value in zip(model.trainable_variables, initial_weights):
    var.assign(value)
  optimizer = optimizers.create_optimizer(config.optimizer, config.train_steps,
                                          global_clipnorm_in_keras=True)
  optimizer.build(model.trainable_variables)

  @tf.function
  def step(batch):
    with tf.GradientTape() as tape:
      out = task.per_example_loss(model, batch, training=True)
      loss = tf.reduce_sum(out.loss * out.weight) / tf.reduce_sum(out.weight)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  for batch in batches:
    step(batch)
  return ([np.array(v) for v in model.trainable_variables],
          [np.array(v) for v in optimizer.variables])


def max_abs_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(a, b))
