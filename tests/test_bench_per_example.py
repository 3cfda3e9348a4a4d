"""The per-example benchmark's interface: flags, rows with a model field, the plot.

Runs the measurement in-process on tiny batches (the figures themselves are not checked here).
"""
import json
import os
import subprocess
import sys

import pytest

from trainer.bench import per_example as bench


def test_flags_models_methods_and_one_line_errors(capsys):
  args = bench._parse(["--models=text_transformer", "--methods=ghost_statistics,batch_gradient",
                       "--batch_sizes=4,8", "--plot", "out.png"])
  assert args.models == ["text_transformer"]
  assert args.methods == ["ghost_statistics", "batch_gradient"]
  assert (args.batch_sizes, args.plot) == ([4, 8], "out.png")
  assert bench._parse([]).models == ["small_cnn", "text_transformer"]
  for bad in (["--models=resnet"], ["--methods=ghost"], ["--batch_sizes=0"],
              # Checked before measuring: it was a traceback after the whole run (a probe).
              ["--json=/nonexistent-microstep/rows.json"], ["--plot=/nonexistent-microstep/p.png"]):
    with pytest.raises(SystemExit):
      bench._parse(bad)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m trainer.bench per_example: error:"), error


def test_in_process_rows_have_model_and_ratio_and_plot(tmp_path, capsys):
  out = tmp_path / "rows.json"
  png = tmp_path / "plot.png"
  assert bench.main(["--models=small_cnn,text_transformer", "--batch_sizes=4",
                     "--methods=ghost_statistics,batch_gradient", "--repeats=1", "--in_process",
                     f"--json={out}", f"--plot={png}"]) == 0
  rows = json.loads(out.read_text())
  assert [(r["model"], r["method"]) for r in rows] == [
      ("small_cnn", "ghost_statistics"), ("small_cnn", "batch_gradient"),
      ("text_transformer", "ghost_statistics"), ("text_transformer", "batch_gradient")]
  for r in rows:
    assert r["median_ms"] > 0 and r["batch_size"] == 4
    assert r["onednn"] is True, r  # tests/conftest.py turns oneDNN on whatever the CPU.
    assert r["ratio_to_batch_gradient"] == pytest.approx(
        r["median_ms"] / next(b["median_ms"] for b in rows
                              if b["model"] == r["model"] and b["method"] == "batch_gradient"),
        abs=1e-3)
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "text_transformer  ghost_statistics" in capsys.readouterr().out


def test_onednn_choice_in_process_after_tensorflow_import_is_refused():
  with pytest.raises(SystemExit) as info:
    bench.main(["--onednn=off", "--in_process", "--models=small_cnn", "--batch_sizes=2"])
  assert "needs a fresh process" in str(info.value) and "\n" not in str(info.value)


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails.
  rows = [{"model": "small_cnn", "method": "batch_gradient", "batch_size": 4,
           "ratio_to_batch_gradient": 1.0}]
  with pytest.raises(SystemExit) as info:
    bench.plot(rows, str(tmp_path / "x.png"))
  assert str(info.value) == "--plot needs matplotlib (pip install matplotlib)"


@pytest.mark.parametrize("onednn", ["off", "on"])
def test_subprocess_rows_take_memory_solo_and_times_from_the_paired_run(tmp_path, onednn):
  # Solo runs give the memory columns and `solo_median_ms`; the paired run, one fresh process
  # timing both methods in turn, gives `median_ms` and the ratio. `--onednn` reaches both, and
  # each row says what its measuring process ran with.
  out = tmp_path / "rows.json"
  assert bench.main(["--models=text_transformer", "--batch_sizes=4", "--repeats=2",
                     "--methods=ghost_statistics,batch_gradient", f"--json={out}",
                     f"--onednn={onednn}"]) == 0
  rows = json.loads(out.read_text())
  assert [r["method"] for r in rows] == ["ghost_statistics", "batch_gradient"]
  for r in rows:
    assert r["timing"] == "paired" and not r.get("error"), r
    assert r["onednn"] is (onednn == "on") and r["cpu"], r
    assert r["solo_median_ms"] > 0 and r["median_ms"] > 0 and r["peak_rss_mib"] > 0, r
    assert r["rss_growth_mib"] is not None, r
    # oneDNN's CPU allocator keeps statistics; TensorFlow's plain one does not.
    # (At B = 4 the model's creation may have been the peak: a number, not its sign.)
    assert (r["tensor_peak_mib"] is not None) is (onednn == "on"), r
  assert rows[0]["ratio_to_batch_gradient"] == pytest.approx(
      rows[0]["median_ms"] / rows[1]["median_ms"], abs=1e-3)



def test_tensor_peak_counts_a_call_s_intermediate_tensors():
  # The tensor column is the allocator's peak over the bytes held before: a call whose
  # intermediates are two [1024, 1024] float32 alive together reads at least 8 MiB. In a fresh
  # process, as the bench measures it (the peak is the process's).
  code = ("import tensorflow as tf; from trainer.bench import per_example as b; "
          "x = tf.ones([1024, 1024]); held = b._tensor_bytes(); "
          "tf.function(lambda t: tf.reduce_sum((t + 1.0) * (t + 2.0)))(x); "
          "print((b._tensor_bytes(peak=True) - held) / 2**20)")
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300, check=True)
  grown = float(out.stdout.strip().splitlines()[-1])
  assert 8.0 <= grown < 16.0, grown
