"""The statistics-cost benchmark's in-process mode: paired rows and ratios (the figures
themselves are not checked here: docs/benchmarks.md)."""
import json
import math
import subprocess
import sys


def test_in_process_rounds_pair_off_and_on_of_each_case(tmp_path):
  out = tmp_path / "cost.json"
  cmd = [sys.executable, "-m", "trainer.bench", "statistics_cost", "--in_process",
         "--updates=2", "--rounds=2", "--cases=default_k1,mirrored_k1", f"--json={out}"]
  # Run from outside the checkout: the recipe is found by path, not as an importable `configs`.
  done = subprocess.run(["timeout", "-k", "10", "600"] + cmd, cwd=tmp_path, capture_output=True,
                        text=True, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  found = json.loads(out.read_text())
  rows = found["rows"]
  # One process per case (Mirrored's logical CPUs must exist before TensorFlow starts).
  assert [(r["case"], r["strategy"], r["every_steps"], r["round"]) for r in rows] == [
      (case, strategy, every, round_index)
      for case, strategy in (("default_k1", "default"), ("mirrored_k1", "mirrored"))
      for round_index in (0, 1) for every in (0, 1)]
  assert all(r["in_process"] and r["updates_per_second"] > 0 for r in rows)
  for case, first in (("default_k1", 0), ("mirrored_k1", 4)):
    ratios = [rows[i + 1]["updates_per_second"] / rows[i]["updates_per_second"]
              for i in (first, first + 2)]
    summary = found["ratio_on_over_off"][case]
    assert summary["n"] == 2
    assert math.isclose(summary["min"], min(ratios)) and math.isclose(summary["max"], max(ratios))
    assert f"{case}: throughput with statistics on every update / off, median" in done.stdout


def test_bad_flags_of_an_absl_benchmark_are_one_line_before_measuring():
  """A --json whose directory does not exist was a traceback after the whole run, and a bad
  flag value absl's two lines and exit 1 (a probe, 2026-12-07)."""
  for args, message in ((["statistics_cost", "--json=/nonexistent-microstep/x.json"],
                         "trainer.bench statistics_cost: error: --json: /nonexistent-microstep/"
                         "x.json: directory /nonexistent-microstep does not exist"),
                        (["statistics_cost", "--updates=abc"],
                         "trainer.bench statistics_cost: error: flag --updates=abc: invalid "
                         "literal for int()")):
    done = subprocess.run(["timeout", "-k", "10", "120", sys.executable, "-m", "trainer.bench"]
                          + args, capture_output=True, text=True, check=False)
    lines = [l for l in done.stderr.strip().splitlines() if not l.startswith(("W", "I", "E"))
             or l.startswith("trainer.bench")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines[-1].startswith(message), lines[-1]
