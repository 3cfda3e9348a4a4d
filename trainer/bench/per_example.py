"""Per-example gradient and statistics benchmark on two models with random data.

`python -m trainer.bench per_example [--models=small_cnn,text_transformer]
    [--batch_sizes=32,128,256] [--methods=...] [--json FILE] [--plot FILE.png] [--repeats N]
    [--onednn=default|on|off]`

Models:
  small_cnn         Conv32-Pool-Conv64-Pool-Dense128-Dense10 on 28x28x1 (189k parameters)
  text_transformer  Embedding(1000, 32) -> MultiHeadAttention(2 heads, key_dim 16) + residual
                    + LayerNormalization -> Dense(32) on [B, 16, 32] -> GlobalAveragePooling1D
                    -> Dense(2), on 16 token ids per example (45k parameters)
Methods (all on the same model and batch):
  seed_loop         eager Python loop of single-example GradientTapes (the question's code)
  jacobian          traced `tape.jacobian(per_example_losses, variables)` (pfor)
  vectorized_map    traced `tf.vectorized_map` of a one-example gradient
  microstep         traced `trainer.per_example.per_example_gradients` (materialised [B, P])
  ghost_statistics  traced `trainer.per_example.ghost_statistics`: the per-replica statistics of
                    one batch (norms, dots with the batch gradient, ...) without [B, P]
  batch_gradient    traced gradient of the mean loss (the reference cost)

Each (model, method, batch size) first runs in its own subprocess, eagerly driving traced
functions on the host: 2 warm-up calls, then `repeats` timed calls (`solo_median_ms`) and the
memory columns. Then the methods that ran are timed again together, in one fresh subprocess per
(model, batch size): each is built and warmed up, then one call of each in turn per round, so
that load changes on a shared machine hit every method alike. `median_ms`, `min_ms` and
`ratio_to_batch_gradient` (medians of the same model and batch size) come from that paired run.
`--in_process` does the paired timing in this process and skips the memory runs.
A subprocess that dies (e.g. pfor through MultiHeadAttention with oneDNN on: SIGSEGV) gives a
row with `error` set instead of times.
Memory: `peak_rss_mib` is the subprocess' ru_maxrss; `rss_growth_mib` is that peak minus the
RSS measured after the model and data were built and before the method's first call. RSS also
holds what TensorFlow keeps per graph node (tens of KB each, docs/per_example.md) and what its
threads cache; `tensor_peak_mib` is the tensors alone: the peak of TensorFlow's CPU allocator
in the subprocess minus what it held before the first call (the model's and the data's
tensors). TensorFlow's oneDNN CPU allocator reports it; with oneDNN off the column is None.
Every row records `cpu` and `onednn` (whether TensorFlow's oneDNN kernels were on in the
measuring process): TF 2.20 turns them on by default only on x86 CPUs with AVX512-VNNI/BF16,
AVX-VNNI or AMX, and the ratios differ between the two (docs/benchmarks.md).
`--onednn=on|off` sets TF_ENABLE_ONEDNN_OPTS for the measurement processes; `default` leaves
TensorFlow's choice.
`--plot FILE` draws median time / batch_gradient against B, one line per method, one panel per
model (needs matplotlib).
"""
import argparse
import json
import os
import resource
import sys
import time

from trainer.bench import util as bench_util

METHODS = ("seed_loop", "jacobian", "vectorized_map", "microstep", "ghost_statistics",
           "batch_gradient")
MODELS = ("small_cnn", "text_transformer")
SLOW = ("seed_loop", "jacobian")


def _csv_choice(p, flag, value, allowed):
  chosen = [m for m in value.split(",") if m]
  bad = sorted(set(chosen) - set(allowed))
  if bad or not chosen:
    p.error(f"--{flag}: unknown {bad}; allowed: {','.join(allowed)}")
  return chosen


def _parse(argv):
  argv = list(argv or [])
  if argv and not argv[0].startswith("-"):  # A program name (absl-style argv): no positionals.
    argv = argv[1:]
  p = argparse.ArgumentParser(prog="python -m trainer.bench per_example", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default=",".join(MODELS), help=f"subset of {','.join(MODELS)}")
  p.add_argument("--batch_sizes", default="32,128,256", help="comma-separated ints")
  p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
  p.add_argument("--repeats", type=int, default=20, help="timed calls per fast method")
  p.add_argument("--slow_repeats", type=int, default=3, help="timed calls for seed_loop/jacobian")
  p.add_argument("--slow_methods_max_batch", type=int, default=128,
                 help="skip seed_loop/jacobian above this batch size")
  p.add_argument("--json", default="", help="write the rows as a JSON list to this file")
  p.add_argument("--plot", default="", help="write a PNG of time / batch_gradient vs B here")
  p.add_argument("--in_process", action="store_true",
                 help="time the methods in turn in this process (steadier ratios on a loaded "
                      "machine; no per-method memory)")
  p.add_argument("--onednn", default="default", choices=bench_util.ONEDNN_CHOICES,
                 help="TensorFlow's oneDNN kernels: its own default for this CPU, on or off")
  p.add_argument("--_worker", nargs=4, metavar=("MODEL", "METHOD", "BATCH", "REPEATS"),
                 help=argparse.SUPPRESS)
  p.add_argument("--_paired", nargs=4, metavar=("MODEL", "METHODS", "BATCH", "REPEATS"),
                 help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  try:
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
  except ValueError:
    p.error(f"--batch_sizes must be comma-separated ints; got {args.batch_sizes!r}")
  if not args.batch_sizes or min(args.batch_sizes) < 1:
    p.error("--batch_sizes must list ints >= 1")
  for flag in ("json", "plot"):
    problem = bench_util.unwritable(getattr(args, flag))
    if problem:
      p.error(f"--{flag}: {problem}")
  args.methods = _csv_choice(p, "methods", args.methods, METHODS)
  args.models = _csv_choice(p, "models", args.models, MODELS)
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


def text_transformer(vocabulary=1000, length=16, width=32, classes=2):
  """Embedding -> MultiHeadAttention(2 heads, key_dim 16) + residual -> LayerNormalization ->
  Dense(width, relu) -> GlobalAveragePooling1D -> Dense(classes), on [B, length] token ids."""
  import keras  # pylint: disable=g-import-not-at-top
  L = keras.layers
  keras.utils.set_random_seed(0)
  ids = keras.Input((length,), dtype="int32")
  x = L.Embedding(vocabulary, width)(ids)
  h = L.LayerNormalization()(x + L.MultiHeadAttention(num_heads=2, key_dim=16)(x, x))
  h = L.Dense(width, activation="relu")(h)
  return keras.Model(ids, L.Dense(classes)(L.GlobalAveragePooling1D()(h)))


def model_and_batch(name, batch_size):
  """(model, (x, y)) for a model of MODELS with deterministic random data."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if name == "small_cnn":
    x = tf.random.stateless_normal([batch_size, 28, 28, 1], seed=[1, 2])
    y = tf.random.stateless_uniform([batch_size], seed=[3, 4], maxval=10, dtype=tf.int32)
    return small_cnn(), (x, y)
  x = tf.random.stateless_uniform([batch_size, 16], seed=[1, 2], maxval=1000, dtype=tf.int32)
  y = tf.random.stateless_uniform([batch_size], seed=[3, 4], maxval=2, dtype=tf.int32)
  return text_transformer(), (x, y)


def _make_method(name, model):
  """Returns fn(x, y) computing the method's gradients (traced except seed_loop)."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import per_example as per_example_lib  # pylint: disable=g-import-not-at-top
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
    return tf.function(lambda x, y: per_example_lib.per_example_gradients(model, loss_fn, (x, y)))

  if name == "ghost_statistics":
    return tf.function(lambda x, y: per_example_lib.ghost_statistics(model, loss_fn, (x, y)))

  def batch_gradient(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(loss_fn(model, (x, y)))
    return tape.gradient(loss, variables)
  return tf.function(batch_gradient)


def _median(times):
  times = sorted(times)
  mid = len(times) // 2
  return times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])


def _timed(fn, x, y):
  start = time.perf_counter()
  fn(x, y)  # Eager host call: returns after the computation has run (CPU, synchronous).
  return time.perf_counter() - start


def _row(model_name, method, batch_size, times):
  found = bench_util.machine()
  return {"model": model_name, "method": method, "batch_size": batch_size,
          "median_ms": 1e3 * _median(times), "min_ms": 1e3 * min(times), "repeats": len(times),
          "cpu": found["cpu"], "onednn": found["onednn"]}


def measure(model_name, method, batch_size, repeats):
  """Times one method on one model at one batch size in this process; returns a row dict."""
  model, (x, y) = model_and_batch(model_name, batch_size)
  fn = _make_method(method, model)
  rss_before, held = _rss_mib(), _tensor_bytes()
  for _ in range(2):
    fn(x, y)
  row = _row(model_name, method, batch_size, [_timed(fn, x, y) for _ in range(repeats)])
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  tensor_peak = _tensor_bytes(peak=True)
  row.update(peak_rss_mib=round(peak, 1), rss_growth_mib=round(peak - rss_before, 1),
             tensor_peak_mib=(None if tensor_peak is None or held is None
                              else round((tensor_peak - held) / 2**20, 2)))
  return row


def _tensor_bytes(peak=False):
  """Bytes TensorFlow's CPU allocator holds now, or the most it has held in this process; None
  where it keeps no statistics. (Its statistics are not reset: oneDNN's allocator zeroes the
  bytes in use of small tensors on a reset, which then undercounts.)"""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    return tf.config.experimental.get_memory_info("CPU:0")["peak" if peak else "current"]
  except (ValueError, tf.errors.OpError):
    return None


def measure_interleaved(model_name, methods, batch_size, repeats):
  """Times several methods in this process, one call of each in turn per round (so that a
  shared machine's load changes hit them alike); returns rows without memory columns."""
  model, (x, y) = model_and_batch(model_name, batch_size)
  fns = {m: _make_method(m, model) for m in methods}
  for fn in fns.values():
    for _ in range(2):
      fn(x, y)
  times = {m: [] for m in methods}
  for round_index in range(max(repeats.values())):
    for m, fn in fns.items():
      if round_index < repeats[m]:
        times[m].append(_timed(fn, x, y))
  return [dict(_row(model_name, m, batch_size, times[m]), peak_rss_mib=None, rss_growth_mib=None,
               tensor_peak_mib=None) for m in methods]


def _run_worker(model, method, batch_size, repeats, env):
  cmd = [sys.executable, "-m", "trainer.bench", "per_example", "--_worker", model, method,
         str(batch_size), str(repeats)]
  try:
    return bench_util.run_row(cmd, f"bench worker {model} {method} B={batch_size}",
                              timeout_s=1200, env=env)
  except RuntimeError as e:  # E.g. pfor through MultiHeadAttention: SIGSEGV.
    first = str(e).splitlines()[0].rstrip(":")
    print(f"  {first}", file=sys.stderr, flush=True)
    return {"model": model, "method": method, "batch_size": batch_size, "median_ms": None,
            "min_ms": None, "repeats": repeats, "peak_rss_mib": None, "rss_growth_mib": None,
            "tensor_peak_mib": None,
            "cpu": None, "onednn": None, "error": first}


def _run_paired(model, methods, batch_size, repeats, env):
  """`measure_interleaved` in a fresh subprocess; {method: row}, or {} if it died."""
  cmd = [sys.executable, "-m", "trainer.bench", "per_example", "--_paired", model,
         ",".join(methods), str(batch_size), ",".join(str(repeats[m]) for m in methods)]
  try:
    found = bench_util.run_row(cmd, f"bench paired timing {model} B={batch_size}",
                               timeout_s=1800, env=env)
  except RuntimeError as e:
    print(f"  {str(e).splitlines()[0].rstrip(':')}; keeping the solo times", file=sys.stderr,
          flush=True)
    return {}
  return {r["method"]: r for r in found["rows"]}


def _measure_case(model, methods, batch_size, repeats, env):
  """Rows of one (model, batch size): memory from solo runs, times from the paired run; the
  measurement processes get `env` on top of this one's environment."""
  rows = [_run_worker(model, m, batch_size, repeats[m], env) for m in methods]
  alive = [r["method"] for r in rows if not r.get("error")]
  paired = _run_paired(model, alive, batch_size, repeats, env) if len(alive) > 1 else {}
  for row in rows:
    row["solo_median_ms"] = row["median_ms"]
    if row["method"] in paired:
      row.update(median_ms=paired[row["method"]]["median_ms"],
                 min_ms=paired[row["method"]]["min_ms"])
    row["timing"] = "paired" if row["method"] in paired else "solo"
  return rows


def _num(value, width, digits):
  return f"{float('nan') if value is None else value:>{width}.{digits}f}"


def _table(rows):
  head = (f"{'model':<18}{'method':<18}{'batch':>6}{'median_ms':>11}{'min_ms':>9}{'x batch':>9}"
          f"{'solo_ms':>9}{'peak_MiB':>10}{'growth_MiB':>12}{'tensors_MiB':>13}{'repeats':>9}")
  out = [head, "-" * len(head)]
  for r in rows:
    line = (f"{r['model']:<18}{r['method']:<18}{r['batch_size']:>6}{_num(r['median_ms'], 11, 1)}"
            f"{_num(r['min_ms'], 9, 1)}{_num(r['ratio_to_batch_gradient'], 9, 2)}"
            f"{_num(r.get('solo_median_ms'), 9, 1)}"
            f"{_num(r.get('peak_rss_mib'), 10, 0)}{_num(r.get('rss_growth_mib'), 12, 0)}"
            f"{_num(r.get('tensor_peak_mib'), 13, 1)}{r['repeats']:>9}")
    out.append(line + (f"  {r['error']}" if r.get("error") else ""))
  return "\n".join(out)


def plot(rows, path):
  """PNG: median time / batch_gradient against B, a line per method, a panel per model."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  models = [m for m in MODELS if any(r["model"] == m for r in rows)]
  fig, axes = pyplot.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
  for ax, model in zip(axes[0], models):
    for method in METHODS:
      points = sorted((r["batch_size"], r["ratio_to_batch_gradient"]) for r in rows
                      if r["model"] == model and r["method"] == method
                      and r["ratio_to_batch_gradient"] is not None)
      failed = sorted(r["batch_size"] for r in rows
                      if r["model"] == model and r["method"] == method and r.get("error"))
      label = method + (f" (died at B={','.join(map(str, failed))})" if failed else "")
      if points:
        ax.plot(*zip(*points), marker="o", label=label)
      elif failed:
        ax.plot([], [], marker="x", linestyle="", label=label)
    ax.axhline(1.2, color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["batch_size"] for r in rows if r["model"] == model}))
    for axis in (ax.xaxis, ax.yaxis):
      axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
      axis.set_minor_formatter(ticker.NullFormatter())
    ax.set(title=model, xlabel="batch size B", ylabel="median time / batch gradient")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv) -> int:
  args = _parse(argv)
  env = bench_util.onednn_env(args.onednn)
  if env and args.in_process:
    if "tensorflow" in sys.modules:
      raise SystemExit("--onednn=on|off with --in_process needs a fresh process (TensorFlow is "
                       "already imported); drop --in_process or set TF_ENABLE_ONEDNN_OPTS")
    os.environ.update(env)
  if args._worker:  # pylint: disable=protected-access
    model, method, batch, repeats = args._worker  # pylint: disable=protected-access
    bench_util.print_row(measure(model, method, int(batch), int(repeats)))
    return 0
  if args._paired:  # pylint: disable=protected-access
    model, methods, batch, repeats = args._paired  # pylint: disable=protected-access
    methods = methods.split(",")
    counts = dict(zip(methods, (int(r) for r in repeats.split(","))))
    bench_util.print_row({"rows": measure_interleaved(model, methods, int(batch), counts)})
    return 0
  rows = []
  for model in args.models:
    for batch_size in args.batch_sizes:
      methods = [m for m in args.methods
                 if m not in SLOW or batch_size <= args.slow_methods_max_batch]
      repeats = {m: args.slow_repeats if m in SLOW else args.repeats for m in methods}
      if args.in_process:
        found = measure_interleaved(model, methods, batch_size, repeats)
      else:
        found = _measure_case(model, methods, batch_size, repeats, env)
      for row in found:
        print(f"  {model} {row['method']} B={batch_size}: {_num(row['median_ms'], 0, 1)} ms",
              file=sys.stderr, flush=True)
      rows.extend(found)
  base = {(r["model"], r["batch_size"]): r["median_ms"] for r in rows
          if r["method"] == "batch_gradient"}
  for r in rows:
    b = base.get((r["model"], r["batch_size"]))
    r["ratio_to_batch_gradient"] = (round(r["median_ms"] / b, 3)
                                    if b and r["median_ms"] is not None else None)
  print(_table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  if args.plot:
    plot(rows, args.plot)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
