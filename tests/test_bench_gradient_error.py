"""The gradient-error benchmark (docs/accumulation.md) runs and its rows say what the docs say:
for a batch-level loss, gradcache's update equals the full batch's gradient at any k, plain
`sum` only at k = 1. (Its import of `trainer.sources` was missing after a refactor on
2026-12-07: a NameError that no test saw.)"""
import json
import subprocess
import sys


def test_gradient_error_rows_show_gradcache_exact_and_sum_off_for_a_batch_loss(tmp_path):
  out = tmp_path / "rows.json"
  cmd = [sys.executable, "-m", "trainer.bench", "gradient_error", "--examples=16", "--ks=1,2",
         "--seeds=1", f"--json={out}"]
  done = subprocess.run(["timeout", "-k", "10", "300"] + cmd, cwd=tmp_path, capture_output=True,
                        text=True, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = {(r["mode"], r["k"]): r for r in json.loads(out.read_text())}
  assert set(rows) == {("sum", 1), ("sum", 2), ("gradcache", 1), ("gradcache", 2)}
  for key in (("sum", 1), ("gradcache", 1), ("gradcache", 2)):
    assert rows[key]["relative_error"] <= 1e-5, rows[key]
  assert rows[("sum", 2)]["relative_error"] > 1e-2, rows[("sum", 2)]
