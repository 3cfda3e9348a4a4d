"""Shared by the benchmarks: run one measurement in a fresh process and read its result row.

A measurement process prints its result as one line `ROW <json>` on stdout (`print_row`); the
parent (`run_row`) starts it, waits, and parses the last such line. A fresh process per
measurement keeps peak memory (ru_maxrss) and warm caches of one case out of the next. Eager, host.
"""
import json
import os
import subprocess

_PREFIX = "ROW "


def print_row(row: dict) -> None:
  print(_PREFIX + json.dumps(row), flush=True)


def run_row(cmd: list, what: str, timeout_s: int = 1800) -> dict:
  """Runs `cmd`, returns its last ROW as a dict; raises RuntimeError naming `what` on failure."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
  done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s,
                        check=False)
  rows = [line for line in done.stdout.splitlines() if line.startswith(_PREFIX)]
  if done.returncode or not rows:
    raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
  return json.loads(rows[-1][len(_PREFIX):])
