"""Shared by the benchmarks: run one measurement in a fresh process and read its result row.

A measurement process prints its result as one line `ROW <json>` on stdout (`print_row`); the
parent (`run_row`) starts it, waits, and parses the last such line. A fresh process per
measurement keeps peak memory (ru_maxrss) and warm caches of one case out of the next. Eager, host.
"""
import functools
import json
import os
import subprocess

_PREFIX = "ROW "


ONEDNN_CHOICES = ("default", "on", "off")


def unwritable(path: str) -> str:
  """'' when an output file can be made at `path` (or none is asked), else why not: checked
  before measuring, so that minutes of rows are not lost to a typo in the directory."""
  if not path:
    return ""
  if os.path.isdir(path):
    return f"{path} is a directory; name a file"
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    return f"{path}: directory {directory} does not exist"
  if not os.access(directory, os.W_OK):
    return f"{path}: directory {directory} is not writable"
  return ""


def onednn_env(choice: str) -> dict:
  """Environment for measurement processes that sets TensorFlow's oneDNN kernels on or off.

  `default` ({}) leaves TensorFlow's own choice: in TF 2.20 oneDNN is on by default only on x86
  CPUs with AVX512-VNNI/BF16, AVX-VNNI or AMX (e.g. AMD Zen 4), off on others (e.g. AMD Zen 3),
  which changes kernel speeds by up to 3x and which method is fastest. The variable only acts
  in a process that has not imported TensorFlow yet.
  """
  if choice not in ONEDNN_CHOICES:
    raise ValueError(f"onednn: {choice!r}; allowed: {', '.join(ONEDNN_CHOICES)}")
  return {} if choice == "default" else {"TF_ENABLE_ONEDNN_OPTS": "1" if choice == "on" else "0"}


@functools.lru_cache(maxsize=None)
def machine() -> dict:
  """What the numbers of this process depend on: `cpu` (model name, family and model) and
  `onednn`, whether TensorFlow's oneDNN kernels are on (None where it cannot be told). Read
  once per process (rows call it each); imports TensorFlow."""
  import platform  # pylint: disable=g-import-not-at-top
  from trainer.per_example import kernels  # pylint: disable=g-import-not-at-top
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines()
                    if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    cpu = (f"{fields.get('model name', cpu)} (family {fields.get('cpu family')}, model "
           f"{fields.get('model')})")
  except (OSError, ValueError):
    pass
  return {"cpu": cpu, "onednn": kernels.onednn_on()}


def recipe(module: str, arg: str = ""):
  """`get_config(arg)` of the recipe `configs/<module>.py` of the checkout that holds this
  package, loaded by path: the benchmarks run from any directory (`configs/` is not an
  installed package). Eager, host."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  path = os.path.join(root, "configs", f"{module}.py")
  if not os.path.isfile(path):
    raise SystemExit(f"trainer.bench: needs the recipe {path} (the benchmarks run from a source "
                     "checkout, installed with pip install -e)")
  spec = importlib.util.spec_from_file_location(f"microstep_recipe_{module}", path)
  loaded = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(loaded)
  return loaded.get_config(arg)


def print_row(row: dict) -> None:
  print(_PREFIX + json.dumps(row), flush=True)


def run_row(cmd: list, what: str, timeout_s: int = 1800, env: dict | None = None) -> dict:
  """Runs `cmd`, returns its last ROW as a dict; raises RuntimeError naming `what` on failure.
  `env`: variables set for it on top of this process' environment."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
             **(env or {}))
  done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s,
                        check=False)
  rows = [line for line in done.stdout.splitlines() if line.startswith(_PREFIX)]
  if done.returncode or not rows:
    raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
  return json.loads(rows[-1][len(_PREFIX):])


def time_updates(config, updates: int, repeats: int = 1) -> list:
  """Seconds per update of `config`'s trainer, one figure per repeat (eager, host).

  Builds the trainer with `run.build` in a temporary workdir, runs one update (tracing), then
  `repeats` times runs `updates` updates in one Orbit loop and divides. Memory and caches of
  this process are the caller's: run one case per process (`run_row`).
  """
  import tempfile  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import run  # pylint: disable=g-import-not-at-top
  config.train_steps = max(config.train_steps, 1 + updates * repeats)
  with tempfile.TemporaryDirectory() as workdir:
    _, trainer, _, _, _ = run.build(config, workdir)
    trainer.train(tf.constant(1))
    seconds = []
    for _ in range(repeats):
      start = time.perf_counter()
      trainer.train(tf.constant(updates))
      seconds.append((time.perf_counter() - start) / updates)
  return seconds


def spread(values) -> dict:
  """Median, min and max of a list of numbers (for ratios measured over rounds)."""
  ordered = sorted(values)
  mid = len(ordered) // 2
  median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
  return {"median": median, "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def paired_rounds(benchmark: str, names, settings, key: str, rounds: int, extra_args=()):
  """Times two settings of each case in alternation, each in its own process; eager, host.

  For every name in `names`, `rounds` times: runs `python -m trainer.bench BENCHMARK
  --case=NAME,SETTING [extra_args]` for settings[0] then settings[1] and divides their `key`
  (settings[1] / settings[0]). Returns (rows, {name: spread of the ratios}).
  """
  import sys  # pylint: disable=g-import-not-at-top
  rows, summary = [], {}
  for name in names:
    ratios = []
    for _ in range(rounds):
      pair = []
      for setting in settings:
        cmd = [sys.executable, "-m", "trainer.bench", benchmark, f"--case={name},{setting}"]
        pair.append(run_row(cmd + list(extra_args), f"{benchmark} {name} {setting}"))
      rows.extend(pair)
      ratios.append(pair[1][key] / pair[0][key])
    summary[name] = spread(ratios)
  return rows, summary


def print_summary(summary: dict, what: str) -> None:
  for name, s in summary.items():
    print(f"{name}: {what}, median {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}, "
          f"{s['n']} rounds)")
