r"""Benchmark: time per optimizer update with XLA off and on (`config.xla`).

  python -m trainer.bench xla [--cases=small_cnn,vgg_triplet] [--rounds=3] [--json=FILE]

Cases (synthetic data, default strategy, on whatever device the process finds):
  small_cnn     configs/fashion_mnist.py: small CNN, batch 128, k=1, 40 updates per timing;
  vgg_triplet   configs/triplet_vgg.py: VGG-16 layout at 1/8 width, 32x32, 32 micro-batches of
                1 per update, 3 updates per timing.
Each (case, xla) runs in its own process; the two settings alternate over `--rounds`. Reported:
median seconds per update per setting, and the ratio on/off per round (median, min, max).
Eager, host.
"""
import json

from absl import flags

from trainer.bench import util as bench_util

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", ["small_cnn", "vgg_triplet"], "Which cases to time.")
flags.DEFINE_integer("rounds", 3, "Alternating rounds (off, on) per case.")
flags.DEFINE_string("json", "", "Write the rows and ratios as JSON here.")
flags.DEFINE_string("case", "", "Internal: CASE,XLA to time in this process.")

CASES = {
    # name: (recipe module, variant args, accumulation steps, updates per timing)
    "small_cnn": ("fashion_mnist", "synthetic", 1, 40),
    "vgg_triplet": ("triplet_vgg", "synthetic", 32, 3),
}


def _time_case(name: str, xla: str) -> dict:
  module, args, k, updates = CASES[name]
  config = bench_util.recipe(module, args)
  config.accumulation.steps, config.xla = k, xla
  config.data.synthetic_train_examples = max(config.batch_size * k * (updates + 1), 256)
  seconds = bench_util.time_updates(config, updates, repeats=3)
  return {"case": name, "xla": xla, "k": k, "batch_size": config.batch_size,
          "seconds_per_update": bench_util.spread(seconds)["median"]}


def main(argv):
  del argv
  if FLAGS.case:
    bench_util.print_row(_time_case(*FLAGS.case.split(",")))
    return
  unknown = [name for name in FLAGS.cases if name not in CASES]
  if unknown:
    raise SystemExit(f"trainer.bench xla: --cases has {unknown[0]!r}; allowed: {', '.join(CASES)}")
  rows, summary = bench_util.paired_rounds("xla", FLAGS.cases, ("off", "on"),
                                           "seconds_per_update", FLAGS.rounds)
  print(f"{'case':<12} {'xla':>4} {'s/update':>9}")
  for r in rows:
    print(f"{r['case']:<12} {r['xla']:>4} {r['seconds_per_update']:>9.4f}")
  bench_util.print_summary(summary, "time with XLA / without")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump({"rows": rows, "ratio_on_over_off": summary}, f, indent=2)
