r"""Benchmark: memory and time of accumulation (k micro-batches of b) vs one batch of b and of k*b.

  python -m trainer.bench memory [--model=vgg16] [--image_size=64] [--b=8] [--k=8] [--updates=3]
                                 [--json=FILE]

Each case runs in its own subprocess on the default strategy: build the trainer, one warm-up
update (tracing), then `--updates` timed updates. Reported: peak resident memory of the process
(ru_maxrss, includes the TF runtime), median seconds per update, and on a GPU the peak of
`tf.config.experimental.get_memory_info`. Ratios are against the batch-b case (memory) and the
k*b batch (time), as issue 3 asks.
"""
import json
import resource
import statistics
import sys
import tempfile
import time

from absl import flags

from trainer.bench import util as bench_util

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "vgg16", "Model name from trainer.tasks.models.")
flags.DEFINE_integer("image_size", 64, "Input side (multiple of 32 for VGG).")
flags.DEFINE_integer("b", 8, "Micro-batch size.")
flags.DEFINE_integer("k", 8, "Micro-steps per update.")
flags.DEFINE_integer("updates", 3, "Timed updates per case.")
flags.DEFINE_string("json", "", "Write rows as JSON here.")
flags.DEFINE_string("case", "", "Internal: batch,k of the one case to run in this process.")


def _run_case(batch, k):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import config_defaults, run  # pylint: disable=g-import-not-at-top
  config = config_defaults.base_config()
  config.model, config.data.image_size = FLAGS.model, FLAGS.image_size
  config.data.source, config.data.synthetic_train_examples = "synthetic", 1024
  config.batch_size, config.accumulation.steps = batch, k
  config.optimizer.name, config.optimizer.learning_rate = "sgd", 0.01
  config.train_steps = FLAGS.updates + 1
  with tempfile.TemporaryDirectory() as workdir:
    _, trainer, _, _, _ = run.build(config, workdir)
    trainer.train(tf.constant(1))
    times = []
    for _ in range(FLAGS.updates):
      start = time.perf_counter()
      trainer.train(tf.constant(1))
      times.append(time.perf_counter() - start)
  row = {"case": f"{k}x{batch}" if k > 1 else f"1x{batch}", "batch": batch, "k": k,
         "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
         "seconds_per_update": statistics.median(times)}
  if tf.config.list_physical_devices("GPU"):
    row["gpu_peak_mib"] = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
  bench_util.print_row(row)


def main(argv):
  del argv
  if FLAGS.case:
    _run_case(*map(int, FLAGS.case.split(",")))
    return
  b, k = FLAGS.b, FLAGS.k
  rows = []
  for batch, steps in ((b, 1), (b, k), (k * b, 1)):
    cmd = [sys.executable, "-m", "trainer.bench", "memory", f"--case={batch},{steps}",
           f"--model={FLAGS.model}", f"--image_size={FLAGS.image_size}",
           f"--updates={FLAGS.updates}"]
    rows.append(bench_util.run_row(cmd, f"case {batch}x{steps}"))
  small, accumulated, big = rows
  summary = {"memory_kxb_over_b": accumulated["peak_rss_mib"] / small["peak_rss_mib"],
             "memory_kb_over_b": big["peak_rss_mib"] / small["peak_rss_mib"],
             "time_kxb_over_kb": accumulated["seconds_per_update"] / big["seconds_per_update"]}
  print(f"{FLAGS.model} at {FLAGS.image_size}x{FLAGS.image_size}, b={b}, k={k}")
  print(f"{'case':<8} {'peak RSS MiB':>13} {'s/update':>9}")
  for r in rows:
    print(f"{r['case']:<8} {r['peak_rss_mib']:>13.0f} {r['seconds_per_update']:>9.3f}")
  print(f"memory {k}x{b} / 1x{b}: {summary['memory_kxb_over_b']:.3f}   "
        f"memory 1x{k * b} / 1x{b}: {summary['memory_kb_over_b']:.3f}   "
        f"time {k}x{b} / 1x{k * b}: {summary['time_kxb_over_kb']:.3f}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump({"rows": rows, **summary}, f, indent=2)
