r"""Benchmark: what per-example statistics on every update cost the training throughput.

  python -m trainer.bench statistics_cost [--updates=300] [--rounds=3] [--json=FILE]

The default recipe (configs/fashion_mnist.py: small CNN, batch 128, the real Fashion-MNIST when
the Debian package is installed, else synthetic data) trains `--updates` updates with
`per_example.every_steps` = 0 (off) and = 1 (statistics inside every update), for default and
MirroredStrategy over 2 logical CPUs, with accumulation k = 1 and k = 4. Each (case, setting)
runs in its own process after one warm-up update; off and on alternate over `--rounds`.
Reported: updates/s per setting (median over rounds) and the throughput ratio on/off per round
(median, min, max); the goal is >= 0.8. Eager, host.
"""
import json
import os

from absl import flags

from trainer.bench import util as bench_util

FLAGS = flags.FLAGS
flags.DEFINE_integer("updates", 300, "Timed updates per measurement.")
flags.DEFINE_integer("rounds", 3, "Alternating rounds (off, on) per case.")
flags.DEFINE_list("cases", ["default_k1", "default_k4", "mirrored_k1", "mirrored_k4"],
                  "Which cases to time.")
flags.DEFINE_string("json", "", "Write the rows and ratios as JSON here.")
flags.DEFINE_string("case", "", "Internal: CASE,EVERY to time in this process.")

CASES = {"default_k1": ("default", 1), "default_k4": ("default", 4),
         "mirrored_k1": ("mirrored", 1), "mirrored_k4": ("mirrored", 4)}


def _time_case(name: str, every: int) -> dict:
  from configs import fashion_mnist  # pylint: disable=g-import-not-at-top
  from trainer import config_defaults  # pylint: disable=g-import-not-at-top
  strategy, k = CASES[name]
  real = os.path.isdir(config_defaults.DATA_DIR)
  config = fashion_mnist.get_config("" if real else "synthetic")
  config.accumulation.steps, config.per_example.every_steps = k, every
  config.steps_per_loop = FLAGS.updates
  if strategy == "mirrored":
    config.strategy, config.cpu_replicas = "mirrored", 2
  seconds = bench_util.time_updates(config, FLAGS.updates, repeats=1)[0]
  return {"case": name, "every_steps": every, "k": k, "strategy": strategy,
          "data": "fashion_mnist" if real else "synthetic", "updates_per_second": 1.0 / seconds}


def main(argv):
  del argv
  if FLAGS.case:
    name, every = FLAGS.case.split(",")
    bench_util.print_row(_time_case(name, int(every)))
    return
  unknown = [name for name in FLAGS.cases if name not in CASES]
  if unknown:
    raise SystemExit(f"trainer.bench statistics_cost: --cases has {unknown[0]!r}; allowed: "
                     f"{', '.join(CASES)}")
  rows, summary = bench_util.paired_rounds("statistics_cost", FLAGS.cases, (0, 1),
                                           "updates_per_second", FLAGS.rounds,
                                           [f"--updates={FLAGS.updates}"])
  print(f"{'case':<12} {'every_steps':>11} {'updates/s':>10}")
  for r in rows:
    print(f"{r['case']:<12} {r['every_steps']:>11} {r['updates_per_second']:>10.1f}")
  bench_util.print_summary(summary, "throughput with statistics on every update / off")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump({"rows": rows, "ratio_on_over_off": summary}, f, indent=2)
