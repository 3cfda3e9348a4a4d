"""Benchmarks: `python -m trainer.bench NAME [args]`; one module per benchmark in this package.

Each benchmark module exposes `main(argv)` and measures ratios against a baseline in the same run
(never absolute timings in tests). `util` holds what they share. Eager, host-side code.
"""
import pathlib

_NOT_BENCHMARKS = {"__init__", "__main__", "util"}


def available() -> list[str]:
  """Names of the benchmark modules in this package."""
  here = pathlib.Path(__file__).parent
  return sorted(p.stem for p in here.glob("*.py") if p.stem not in _NOT_BENCHMARKS)
