r"""Benchmark: memory and time of accumulation, plain and gradcache, against one big batch.

  python -m trainer.bench memory [--model=vgg16] [--image_size=64] [--b=8] [--k=8]
                                 [--updates=10] [--rounds=3] [--json=FILE]

Cases, each in its own process on the default strategy with synthetic data (one warm-up update,
then `--updates` timed updates in one Orbit loop; peak resident memory of the whole process,
ru_maxrss, TF runtime included; on a GPU also the peak of `tf.config.experimental.
get_memory_info`):

  1xb, kxb, 1xkb           classification (sum): one batch of b, k micro-batches of b, one of k·b
  triplet_1xb, triplet_kxb batch-hard triplet loss, plain averaging (sum)
  gradcache_kxb            batch-hard triplet loss, accumulation.mode=gradcache: exact

The cases run in turn, `--rounds` times (A B C ... A B C ...), so that a machine's changing
load hits them alike; every ratio is taken within a round and reported as median, min and max:

  memory_kxb_over_b, memory_kb_over_b, time_kxb_over_kb               (issue 3: plain)
  memory_gradcache_over_b = gradcache_kxb / triplet_1xb                (goal <= 1.3)
  time_gradcache_over_sum = gradcache_kxb / triplet_kxb                (goal <= 1.5)

Eager, host.
"""
import json
import resource
import sys

from absl import flags

from trainer.bench import util as bench_util

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "vgg16", "Model name from trainer.tasks.models.")
flags.DEFINE_integer("image_size", 64, "Input side (multiple of 32 for VGG).")
flags.DEFINE_integer("b", 8, "Micro-batch size.")
flags.DEFINE_integer("k", 8, "Micro-steps per update.")
flags.DEFINE_integer("updates", 10, "Timed updates per case.")
flags.DEFINE_integer("rounds", 3, "Rounds over all cases.")
flags.DEFINE_list("cases", ["1xb", "kxb", "1xkb", "triplet_1xb", "triplet_kxb", "gradcache_kxb"],
                  "Which cases to run.")
flags.DEFINE_string("json", "", "Write rows and ratios as JSON here.")
flags.DEFINE_string("case", "", "Internal: the one case to run in this process.")

# case: (task, accumulation mode, batch size in units of b, micro-steps in units of k)
CASES = {
    "1xb": ("classification", "sum", 1, 0), "kxb": ("classification", "sum", 1, 1),
    "1xkb": ("classification", "sum", "k", 0),
    "triplet_1xb": ("batch_hard_triplet", "sum", 1, 0),
    "triplet_kxb": ("batch_hard_triplet", "sum", 1, 1),
    "gradcache_kxb": ("batch_hard_triplet", "gradcache", 1, 1),
}
RATIOS = {  # name: (numerator case, denominator case, figure)
    "memory_kxb_over_b": ("kxb", "1xb", "peak_rss_mib"),
    "memory_kb_over_b": ("1xkb", "1xb", "peak_rss_mib"),
    "time_kxb_over_kb": ("kxb", "1xkb", "seconds_per_update"),
    "memory_gradcache_over_b": ("gradcache_kxb", "triplet_1xb", "peak_rss_mib"),
    "time_gradcache_over_sum": ("gradcache_kxb", "triplet_kxb", "seconds_per_update"),
}


def _run_case(name):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import config_defaults  # pylint: disable=g-import-not-at-top
  task, mode, batch_units, k_units = CASES[name]
  config = config_defaults.base_config()
  config.task, config.accumulation.mode = task, mode
  config.model, config.data.image_size = FLAGS.model, FLAGS.image_size
  config.data.source, config.data.synthetic_train_examples = "synthetic", 1024
  config.batch_size = FLAGS.b * (FLAGS.k if batch_units == "k" else 1)
  config.accumulation.steps = FLAGS.k if k_units else 1
  config.optimizer.name, config.optimizer.learning_rate = "sgd", 0.01
  config.steps_per_loop = FLAGS.updates
  seconds = bench_util.time_updates(config, FLAGS.updates, repeats=1)[0]
  row = {"case": name, "task": task, "mode": mode, "batch": config.batch_size,
         "k": config.accumulation.steps, "seconds_per_update": seconds,
         "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
  if tf.config.list_physical_devices("GPU"):
    row["gpu_peak_mib"] = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
  bench_util.print_row(row)


def main(argv):
  del argv
  if FLAGS.case:
    _run_case(FLAGS.case)
    return
  unknown = [c for c in FLAGS.cases if c not in CASES]
  if unknown:
    raise SystemExit(f"trainer.bench memory: --cases has {unknown[0]!r}; allowed: "
                     f"{', '.join(CASES)}")
  rounds, rows = [], []
  for _ in range(FLAGS.rounds):
    found = {}
    for name in FLAGS.cases:
      cmd = [sys.executable, "-m", "trainer.bench", "memory", f"--case={name}",
             f"--model={FLAGS.model}", f"--image_size={FLAGS.image_size}", f"--b={FLAGS.b}",
             f"--k={FLAGS.k}", f"--updates={FLAGS.updates}"]
      found[name] = bench_util.run_row(cmd, f"memory case {name}")
      rows.append(found[name])
    rounds.append(found)
  summary = {}
  for ratio, (top, bottom, figure) in RATIOS.items():
    values = [r[top][figure] / r[bottom][figure] for r in rounds if top in r and bottom in r]
    if values:
      summary[ratio] = bench_util.spread(values)
  print(f"{FLAGS.model} at {FLAGS.image_size}x{FLAGS.image_size}, b={FLAGS.b}, k={FLAGS.k}, "
        f"{FLAGS.updates} timed updates per case, {FLAGS.rounds} rounds")
  print(f"{'case':<15} {'peak RSS MiB':>13} {'s/update':>9}")
  for r in rows:
    print(f"{r['case']:<15} {r['peak_rss_mib']:>13.0f} {r['seconds_per_update']:>9.3f}")
  bench_util.print_summary(summary, "ratio")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump({"rows": rows, "ratios": summary}, f, indent=2)
