r"""Benchmark: the Orbit loop against Keras 3 `model.fit`, same model, data, batch and strategy.

  python -m trainer.bench loop [--epochs=5] [--strategy=default|mirrored] [--json=FILE]

Both sides train the small CNN of configs/fashion_mnist.py on the real Fashion-MNIST (batch 128).
Keras (`model.fit`, constant Adam 1e-3 as users write it, one repeated `tf.data` iterator, the fast
form) trains up to
`--keras_epochs` epochs and is evaluated on the 10k test images after each; its time to reach
`--target` accuracy excludes those evaluations. microstep runs the default recipe as it stands
(`--epochs`, then one evaluation). Reported per side: steady examples/s (epochs after the first,
which includes tracing), training+eval wall time, test accuracy; and the ratios ours/Keras. Each
side runs in its own subprocess, alternating over `--rounds`.
"""
import json
import sys
import time

from absl import flags

from trainer.bench import util as bench_util

FLAGS = flags.FLAGS
flags.DEFINE_integer("epochs", 5, "microstep epochs (the default recipe has 5).")
flags.DEFINE_integer("keras_epochs", 10, "Most epochs Keras may take to reach --target.")
flags.DEFINE_float("keras_learning_rate", 1e-3, "Keras side: constant Adam learning rate.")
flags.DEFINE_float("target", 0.90, "Test accuracy defining Keras' time to accuracy.")
flags.DEFINE_string("strategy", "default", "default, or mirrored (all GPUs, else 2 logical CPUs).")
flags.DEFINE_integer("rounds", 1, "Alternating rounds (keras, ours) to run.")
flags.DEFINE_string("json", "", "Write the rows as JSON to this file.")
flags.DEFINE_string("side", "", "Internal: run one side in this process.")
flags.DEFINE_integer("seed", 0, "Seed for both sides.")

STEPS_PER_EPOCH = 60000 // 128


def _config():
  config = bench_util.recipe("fashion_mnist")
  config.seed = FLAGS.seed
  config.train_steps = STEPS_PER_EPOCH * FLAGS.epochs
  config.steps_per_loop = STEPS_PER_EPOCH
  if FLAGS.strategy == "mirrored":  # All local GPUs, or 2 logical CPUs without one.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    config.strategy = "mirrored"
    config.cpu_replicas = 0 if tf.config.list_physical_devices("GPU") else 2
  return config


def _keras_side(config):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import strategies  # pylint: disable=g-import-not-at-top
  from trainer.tasks import fashion_mnist, models  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(config.seed)
  strategy = strategies.create_strategy(config)
  (x, y), (xt, yt) = (fashion_mnist.load_arrays(config.data, "train"),
                      fashion_mnist.load_arrays(config.data, "test"))
  prep = lambda a: (a[..., None] / 255.0).astype("float32")
  train = (tf.data.Dataset.from_tensor_slices((prep(x), y)).shuffle(60000, seed=config.seed)
           .repeat().batch(config.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
  with strategy.scope():
    model = models.classifier(config.model, (28, 28, 1), 10)
    model.compile(optimizer=keras.optimizers.Adam(FLAGS.keras_learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  times, state = [], {"accuracy": 0.0, "to_target": None, "eval_time": 0.0}

  class ClockAndStop(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
      self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
      times.append(time.perf_counter() - self.start)
      t0 = time.perf_counter()
      _, state["accuracy"] = model.evaluate(prep(xt), yt, batch_size=1000, verbose=0)
      state["eval_time"] = time.perf_counter() - t0
      if state["accuracy"] >= FLAGS.target:
        state["to_target"] = sum(times) + state["eval_time"]  # One final evaluation counts.
        self.model.stop_training = True

  model.fit(train, epochs=FLAGS.keras_epochs, steps_per_epoch=STEPS_PER_EPOCH,
            callbacks=[ClockAndStop()], verbose=0)
  wall = state["to_target"] or sum(times) + state["eval_time"]
  return times, wall, state["accuracy"], state["to_target"] is not None


def _orbit_side(config, workdir):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import run  # pylint: disable=g-import-not-at-top
  _, trainer, evaluator, _, eval_steps = run.build(config, workdir)
  times = []
  start = time.perf_counter()
  for _ in range(FLAGS.epochs):
    t0 = time.perf_counter()
    trainer.train(tf.constant(STEPS_PER_EPOCH))
    times.append(time.perf_counter() - t0)
  accuracy = float(evaluator.evaluate(tf.constant(eval_steps))["accuracy"])
  return times, time.perf_counter() - start, accuracy, accuracy >= FLAGS.target


def _one_side(side):
  import tempfile  # pylint: disable=g-import-not-at-top
  config = _config()
  if side == "keras":
    times, wall, accuracy, reached = _keras_side(config)
  else:
    with tempfile.TemporaryDirectory() as workdir:
      times, wall, accuracy, reached = _orbit_side(config, workdir)
  steady = sum(times[1:]) / max(len(times) - 1, 1)
  row = {"method": side, "strategy": FLAGS.strategy, "epochs": len(times),
         "examples_per_second": STEPS_PER_EPOCH * config.batch_size / steady,
         "train_eval_seconds": wall, "test_accuracy": accuracy, "reached_target": reached}
  bench_util.print_row(row)


def main(argv):
  del argv
  if FLAGS.side:
    _one_side(FLAGS.side)
    return
  rows = []
  for _ in range(FLAGS.rounds):
    for side in ("keras", "microstep"):
      cmd = [sys.executable, "-m", "trainer.bench", "loop", f"--side={side}",
             f"--epochs={FLAGS.epochs}", f"--keras_epochs={FLAGS.keras_epochs}",
             f"--target={FLAGS.target}", f"--strategy={FLAGS.strategy}", f"--seed={FLAGS.seed}",
             f"--keras_learning_rate={FLAGS.keras_learning_rate}"]
      rows.append(bench_util.run_row(cmd, f"{side} side"))
  print(f"{'method':<10} {'strategy':<9} {'epochs':>6} {'examples/s':>11} {'train+eval s':>13} "
        f"{'test acc':>9}")
  for r in rows:
    print(f"{r['method']:<10} {r['strategy']:<9} {r['epochs']:>6} {r['examples_per_second']:>11.0f} "
          f"{r['train_eval_seconds']:>13.1f} {r['test_accuracy']:>9.4f}")
  ours = [r for r in rows if r["method"] == "microstep"]
  theirs = [r for r in rows if r["method"] == "keras"]
  ratio = (sum(r["examples_per_second"] for r in ours) / sum(r["examples_per_second"] for r in theirs))
  time_ratio = sum(r["train_eval_seconds"] for r in ours) / sum(r["train_eval_seconds"] for r in theirs)
  print(f"ratio examples/s ours/keras: {ratio:.3f}; train+eval time ours/keras: {time_ratio:.3f}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump({"rows": rows, "examples_per_second_ratio": ratio, "time_ratio": time_ratio}, f, indent=2)
