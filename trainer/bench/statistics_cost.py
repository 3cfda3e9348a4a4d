r"""Benchmark: what per-example statistics on every update cost the training throughput.

  python -m trainer.bench statistics_cost [--updates=300] [--rounds=3] [--in_process]
      [--cases=default_k1,...] [--json=FILE]

The default recipe (configs/fashion_mnist.py: small CNN, batch 128, the real Fashion-MNIST when
the Debian package is installed, else synthetic data) trains `--updates` updates with
`per_example.every_steps` = 0 (off) and = 1 (statistics inside every update), for default and
MirroredStrategy over 2 logical CPUs, with accumulation k = 1 and k = 4. Each (case, setting)
runs in its own process after one warm-up update; off and on alternate over `--rounds`.
`--in_process` builds both settings' trainers of a case in one process instead (one process per
case: a MirroredStrategy over logical CPUs must exist before TensorFlow starts) and, after one
untimed block each, times them in alternating blocks of `--updates`: paired in time, without
the 10-30% by which separate processes of one setting differ on a shared 2-core machine.
Reported: updates/s per setting and round, and the throughput ratio on/off per round (median,
min, max); the goal is >= 0.8. Eager, host.
"""
import contextlib
import json
import os
import sys
import tempfile
import time

from absl import flags

from trainer.bench import util as bench_util

FLAGS = flags.FLAGS
flags.DEFINE_integer("updates", 300, "Timed updates per measurement.")
flags.DEFINE_integer("rounds", 3, "Alternating rounds (off, on) per case.")
flags.DEFINE_list("cases", ["default_k1", "default_k4", "mirrored_k1", "mirrored_k4"],
                  "Which cases to time.")
flags.DEFINE_string("json", "", "Write the rows and ratios as JSON here.")
flags.DEFINE_string("case", "", "Internal: CASE,EVERY (or CASE with --in_process) to time in "
                    "this process.")
flags.DEFINE_bool("in_process", False, "Time off and on of a case in one process, in "
                  "alternating blocks (default: a fresh process per case, setting and round).")

CASES = {"default_k1": ("default", 1), "default_k4": ("default", 4),
         "mirrored_k1": ("mirrored", 1), "mirrored_k4": ("mirrored", 4)}


def _config(name: str, every: int):
  """The default recipe's config for one case and setting; and the row fields naming them."""
  from trainer import config_defaults  # pylint: disable=g-import-not-at-top
  strategy, k = CASES[name]
  real = os.path.isdir(config_defaults.DATA_DIR)
  config = bench_util.recipe("fashion_mnist", "" if real else "synthetic")
  config.accumulation.steps, config.per_example.every_steps = k, every
  config.steps_per_loop = FLAGS.updates
  if strategy == "mirrored":
    config.strategy, config.cpu_replicas = "mirrored", 2
  return config, {"case": name, "every_steps": every, "k": k, "strategy": strategy,
                  "data": "fashion_mnist" if real else "synthetic"}


def _time_case(name: str, every: int) -> dict:
  config, row = _config(name, every)
  seconds = bench_util.time_updates(config, FLAGS.updates, repeats=1)[0]
  return dict(row, updates_per_second=1.0 / seconds)


def _paired_in_process(name: str) -> dict:
  """{"rows", "ratios"}: both trainers of case `name` built in this process, timed in turn."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import run  # pylint: disable=g-import-not-at-top
  rows, ratios = [], []
  with contextlib.ExitStack() as stack:
    trainers, fields = {}, {}
    for every in (0, 1):
      config, fields[every] = _config(name, every)
      config.train_steps = max(config.train_steps, 1 + FLAGS.updates * (FLAGS.rounds + 1))
      workdir = stack.enter_context(tempfile.TemporaryDirectory())
      trainers[every] = run.build(config, workdir)[1]
      trainers[every].train(tf.constant(1))  # Tracing.
    for every in (0, 1):  # One untimed block each: input pipelines and caches warm.
      trainers[every].train(tf.constant(FLAGS.updates))
    for round_index in range(FLAGS.rounds):
      speed = {}
      for every in ((0, 1) if round_index % 2 == 0 else (1, 0)):
        start = time.perf_counter()
        trainers[every].train(tf.constant(FLAGS.updates))
        speed[every] = FLAGS.updates / (time.perf_counter() - start)
      rows.extend(dict(fields[every], updates_per_second=speed[every], round=round_index,
                       in_process=True) for every in (0, 1))
      ratios.append(speed[1] / speed[0])
  return {"rows": rows, "ratios": ratios}


def main(argv):
  del argv
  if FLAGS.case and FLAGS.in_process:
    bench_util.print_row(_paired_in_process(FLAGS.case))
    return
  if FLAGS.case:
    name, every = FLAGS.case.split(",")
    bench_util.print_row(_time_case(name, int(every)))
    return
  unknown = [name for name in FLAGS.cases if name not in CASES]
  if unknown:
    raise SystemExit(f"trainer.bench statistics_cost: --cases has {unknown[0]!r}; allowed: "
                     f"{', '.join(CASES)}")
  if FLAGS.in_process:
    rows, summary = [], {}
    for name in FLAGS.cases:
      found = bench_util.run_row(
          [sys.executable, "-m", "trainer.bench", "statistics_cost", f"--case={name}",
           "--in_process", f"--updates={FLAGS.updates}", f"--rounds={FLAGS.rounds}"],
          f"statistics_cost {name} in one process")
      rows.extend(found["rows"])
      summary[name] = bench_util.spread(found["ratios"])
  else:
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
