r"""Benchmark: cross-replica reductions per optimizer update, microstep vs Keras 3 accumulation.

  python -m trainer.bench collectives [--k=4] [--json=FILE]

Both sides train the small CNN under MirroredStrategy over 2 logical CPU devices with k
micro-steps per update. Counted per update:
  * `all_reduce calls` and `tensors reduced`: replica-context `all_reduce` calls (outermost, on a
    context with more than one replica) made while ONE update runs or is traced, and how many
    tensors they carry;
  * `cross-device reductions`: every reduction through `tf.distribute.CrossDeviceOps`, including
    those hidden in mirrored-variable updates (Keras' ON_WRITE accumulators);
  * `collective ops`: CollectiveReduce* ops in the traced update graph (MirroredStrategy on CPUs
    uses collective ops; one op per replica device per reduction).
Keras 3's `gradient_accumulation_steps` is measured inside `model.fit`; where it cannot be traced
under the strategy (the `merge_call` error of keras #20582), the eager count is reported and
the error is printed. Runs eagerly on the host, one process.
"""
import json

from absl import flags

from trainer import collectives

FLAGS = flags.FLAGS
flags.DEFINE_integer("k", 4, "Micro-steps per update.")
flags.DEFINE_string("json", "", "Write the rows as JSON here.")


def _config(k):
  from trainer import config_defaults  # pylint: disable=g-import-not-at-top
  config = config_defaults.base_config()
  config.data.source = "synthetic"
  config.strategy, config.cpu_replicas = "mirrored", 2
  config.batch_size, config.accumulation.steps = 32, k
  return config


def _ours(k):
  import tempfile  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import run  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as workdir:
    strategy, trainer, _, _, _ = run.build(_config(k), workdir)
    iterator = iter(trainer.train_dataset)
    with collectives.AllReduceCounter() as counter:
      graph = tf.function(trainer.train_step).get_concrete_function(iterator)
    del strategy
  return {"method": "microstep", "k": k, "traced": True, "all_reduce_calls": counter.calls,
          "tensors_reduced": counter.tensors, "cross_device_reductions": counter.cross_device, "collective_ops": collectives.collective_reduce_ops(graph),
          "variables": len(trainer.model.trainable_variables), "error": ""}


def _keras(k, run_eagerly):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import strategies  # pylint: disable=g-import-not-at-top
  from trainer.tasks import models  # pylint: disable=g-import-not-at-top
  config = _config(k)
  strategy = strategies.create_strategy(config)
  x = tf.random.uniform((config.batch_size * k, 28, 28, 1))
  y = tf.random.uniform((config.batch_size * k,), maxval=10, dtype=tf.int64)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(config.batch_size)
  with strategy.scope():
    model = models.classifier("small_cnn", (28, 28, 1), 10)
    model.compile(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=k),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  run_eagerly=run_eagerly)
  row = {"method": "keras_gradient_accumulation_steps" + ("_eager" if run_eagerly else ""),
         "k": k, "traced": not run_eagerly, "variables": len(model.trainable_variables),
         "collective_ops": None, "error": ""}
  try:
    with collectives.AllReduceCounter() as counter:
      model.fit(dataset, epochs=1, steps_per_epoch=k, verbose=0)
    # Eagerly every call executes; traced, each distinct trace is counted once.
    row.update(all_reduce_calls=counter.calls, tensors_reduced=counter.tensors,
               cross_device_reductions=counter.cross_device)
  except Exception as e:  # pylint: disable=broad-except
    row.update(all_reduce_calls=None, tensors_reduced=None, cross_device_reductions=None,
               error=str(e).splitlines()[0][:160])
  return row


def main(argv):
  del argv
  rows = [_ours(FLAGS.k), _keras(FLAGS.k, run_eagerly=False), _keras(FLAGS.k, run_eagerly=True)]
  print(f"per update of k={FLAGS.k} micro-steps, MirroredStrategy over 2 logical CPUs, small CNN")
  print(f"{'method':<40} {'all_reduce calls':>16} {'tensors':>8} {'cross-device':>13} "
        f"{'collective ops':>15}  note")
  for r in rows:
    fmt = lambda v: "-" if v is None else str(v)
    print(f"{r['method']:<40} {fmt(r['all_reduce_calls']):>16} {fmt(r['tensors_reduced']):>8} "
          f"{fmt(r['cross_device_reductions']):>13} {fmt(r['collective_ops']):>15}  {r['error']}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(rows, f, indent=2)
