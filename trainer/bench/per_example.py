"""Per-example gradient benchmark on the small Fashion-MNIST CNN (random 28x28x1 data).

`python -m trainer.bench per_example [--batch_sizes=32,128,256] [--json FILE] [--repeats N]`

Methods (all on the same model and batch):
  seed_loop       eager Python loop of single-example GradientTapes (the question's code)
  jacobian        traced `tape.jacobian(per_example_losses, variables)` (pfor)
  vectorized_map  traced `tf.vectorized_map` of a one-example gradient
  microstep       traced `trainer.per_example.per_example_gradients`
  batch_gradient  traced gradient of the mean loss (the reference cost)

Each (method, batch size) runs in its own subprocess (unless --in_process), eagerly driving
traced functions on the host: 2 warm-up calls, then the median (and min) wall time of
`repeats` calls; `ratio_to_batch_gradient` divides medians at the same batch size.
Memory: `peak_rss_mib` is the subprocess' ru_maxrss; `rss_growth_mib` is that peak minus the
RSS measured after the model and data were built and before the method's first call.
"""
import argparse
import json
import os
import resource
import sys
import time

from trainer.bench import util as bench_util

METHODS = ("seed_loop", "jacobian", "vectorized_map", "microstep", "batch_gradient")
SLOW = ("seed_loop", "jacobian")


def _parse(argv):
  argv = list(argv or [])
  if argv and not argv[0].startswith("-"):  # A program name (absl-style argv): no positionals.
    argv = argv[1:]
  p = argparse.ArgumentParser(prog="python -m trainer.bench per_example", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch_sizes", default="32,128,256", help="comma-separated ints")
  p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
  p.add_argument("--repeats", type=int, default=20, help="timed calls per fast method")
  p.add_argument("--slow_repeats", type=int, default=3, help="timed calls for seed_loop/jacobian")
  p.add_argument("--slow_methods_max_batch", type=int, default=128,
                 help="skip seed_loop/jacobian above this batch size")
  p.add_argument("--json", default="", help="write the rows as a JSON list to this file")
  p.add_argument("--in_process", action="store_true",
                 help="run everything in this process (faster; no per-method memory)")
  p.add_argument("--_worker", nargs=3, metavar=("METHOD", "BATCH", "REPEATS"),
                 help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  try:
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
  except ValueError:
    p.error(f"--batch_sizes must be comma-separated ints; got {args.batch_sizes!r}")
  if not args.batch_sizes or min(args.batch_sizes) < 1:
    p.error("--batch_sizes must list ints >= 1")
  args.methods = [m for m in args.methods.split(",") if m]
  bad = sorted(set(args.methods) - set(METHODS))
  if bad:
    p.error(f"--methods: unknown {bad}; allowed: {','.join(METHODS)}")
  if args.repeats < 1 or args.slow_repeats < 1:
    p.error("--repeats and --slow_repeats must be >= 1")
  return args


def _rss_mib():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def small_cnn():
  """Conv32(3x3,relu)-MaxPool-Conv64(3x3,relu)-MaxPool-Flatten-Dense128(relu)-Dense10."""
  import keras  # pylint: disable=g-import-not-at-top
  L = keras.layers
  keras.utils.set_random_seed(0)
  return keras.Sequential([
      keras.Input((28, 28, 1)), L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(),
      L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(), L.Flatten(),
      L.Dense(128, activation="relu"), L.Dense(10)])


def _make_method(name, model):
  """Returns fn(x, y) computing the method's gradients (traced except seed_loop)."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer.per_example import per_example_gradients  # pylint: disable=g-import-not-at-top
  variables = model.trainable_variables
  per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def loss_fn(m, batch):
    return per_example(batch[1], m(batch[0], training=True))

  if name == "seed_loop":
    def seed_loop(x, y):
      grads = []
      for index in range(len(x)):
        with tf.GradientTape() as tape:
          prediction = model(x[index:index + 1], training=True)
          loss = loss_object(y[index:index + 1], prediction)
        grads.append(tape.gradient(loss, variables))
      return grads
    return seed_loop

  if name == "jacobian":
    def jacobian(x, y):
      with tf.GradientTape() as tape:
        losses = loss_fn(model, (x, y))
      return tape.jacobian(losses, variables)
    return tf.function(jacobian)

  if name == "vectorized_map":
    def one(example):
      x, y = example
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loss_fn(model, (x[None], y[None])))
      return tape.gradient(loss, variables)
    return tf.function(lambda x, y: tf.vectorized_map(one, (x, y)))

  if name == "microstep":
    return tf.function(lambda x, y: per_example_gradients(model, loss_fn, (x, y)))

  def batch_gradient(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(loss_fn(model, (x, y)))
    return tape.gradient(loss, variables)
  return tf.function(batch_gradient)


def measure(method, batch_size, repeats):
  """Times one method at one batch size in this process; returns a row dict."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  model = small_cnn()
  x = tf.random.stateless_normal([batch_size, 28, 28, 1], seed=[1, 2])
  y = tf.random.stateless_uniform([batch_size], seed=[3, 4], maxval=10, dtype=tf.int32)
  fn = _make_method(method, model)
  rss_before = _rss_mib()
  for _ in range(2):
    fn(x, y)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(x, y)  # Eager host call: returns after the computation has run (CPU, synchronous).
    times.append(time.perf_counter() - start)
  times.sort()
  mid = len(times) // 2
  median = times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  return {"method": method, "batch_size": batch_size, "median_ms": 1e3 * median,
          "min_ms": 1e3 * times[0],
          "repeats": repeats, "peak_rss_mib": round(peak, 1),
          "rss_growth_mib": round(peak - rss_before, 1)}


def _run_worker(method, batch_size, repeats):
  cmd = [sys.executable, "-m", "trainer.bench", "per_example", "--_worker", method,
         str(batch_size), str(repeats)]
  return bench_util.run_row(cmd, f"bench worker {method} B={batch_size}", timeout_s=1200)


def _table(rows):
  head = (f"{'method':<16}{'batch':>6}{'median_ms':>11}{'min_ms':>9}{'x batch':>9}{'peak_MiB':>10}"
          f"{'growth_MiB':>12}{'repeats':>9}")
  out = [head, "-" * len(head)]
  for r in rows:
    out.append(f"{r['method']:<16}{r['batch_size']:>6}{r['median_ms']:>11.1f}{r['min_ms']:>9.1f}"
               f"{r['ratio_to_batch_gradient'] or float('nan'):>9.2f}"
               f"{r.get('peak_rss_mib') or float('nan'):>10.0f}"
               f"{r.get('rss_growth_mib') or float('nan'):>12.0f}{r['repeats']:>9}")
  return "\n".join(out)


def main(argv) -> int:
  args = _parse(argv)
  if args._worker:  # pylint: disable=protected-access
    method, batch, repeats = args._worker  # pylint: disable=protected-access
    bench_util.print_row(measure(method, int(batch), int(repeats)))
    return 0
  rows = []
  for batch_size in args.batch_sizes:
    for method in args.methods:
      if method in SLOW and batch_size > args.slow_methods_max_batch:
        continue
      repeats = args.slow_repeats if method in SLOW else args.repeats
      if args.in_process:
        row = measure(method, batch_size, repeats)
        row["peak_rss_mib"] = row["rss_growth_mib"] = None
      else:
        row = _run_worker(method, batch_size, repeats)
      rows.append(row)
      print(f"  {method} B={batch_size}: {row['median_ms']:.1f} ms", file=sys.stderr, flush=True)
  base = {r["batch_size"]: r["median_ms"] for r in rows if r["method"] == "batch_gradient"}
  for r in rows:
    b = base.get(r["batch_size"])
    r["ratio_to_batch_gradient"] = round(r["median_ms"] / b, 3) if b else None
  print(_table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
