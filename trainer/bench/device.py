r"""Benchmark: everything to measure on the first accelerator, in one run.

  python -m trainer.bench device [--json=FILE] [--epochs=2] [--skip=...]

On a machine with GPUs it prints, in one run:
  fit            default recipe examples/s against Keras 3 `model.fit` on ONE device (Keras
                 compiles with XLA as it decides: on for a GPU without a strategy);
  mirrored       the same under MirroredStrategy over all local GPUs;
  per_example    per-example gradients and ghost statistics, ratio to a batch gradient (B=128);
  memory         peak memory of accumulation (VGG-16 body, 8 micro-batches of 8) against one
                 batch of 8 and of 64: `tf.config.experimental.get_memory_info` on a GPU;
  exactness      the accumulation exactness tests, run on this machine (the default-strategy
                 cases run on GPU:0).
Without a GPU it says so and runs the same steps on the CPU (MirroredStrategy then uses 2 logical
CPU devices). Each step is a subprocess (the other benchmarks and pytest); a failing step is
reported and the others still run. Eager, host.
"""
import json
import os
import subprocess
import sys
import time

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("json", "", "Write the results as JSON here.")
flags.DEFINE_integer("epochs", 2, "Epochs per side for the fit and mirrored comparisons.")
flags.DEFINE_list("skip", [], "Steps to leave out: fit, mirrored, per_example, memory, exactness.")

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _devices() -> dict:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = tf.config.list_physical_devices("GPU")
  names = [tf.config.experimental.get_device_details(g).get("device_name", g.name) for g in gpus]
  return {"tensorflow": tf.__version__, "gpus": names, "on": "gpu" if gpus else "cpu"}


def _run(step: str, cmd: list, timeout_s: int) -> dict:
  """Runs one step; returns its JSON output (if any), exit code, seconds and output tail."""
  out = os.path.join("/tmp", f"microstep_device_{step}_{os.getpid()}.json")
  cmd = [c.replace("{json}", out) for c in cmd]
  start = time.perf_counter()
  try:
    done = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), check=False)
    code, tail = done.returncode, (done.stdout + done.stderr)[-1500:]
  except subprocess.TimeoutExpired:
    code, tail = 124, f"timed out after {timeout_s} s"
  result = {"step": step, "exit_code": code, "seconds": round(time.perf_counter() - start, 1),
            "last_line": next((l for l in reversed(tail.splitlines()) if l.strip()), "")}
  if os.path.exists(out):
    with open(out) as f:
      result["result"] = json.load(f)
    os.remove(out)
  if code:
    result["output_tail"] = tail
  print(f"[{step}] exit {code} in {result['seconds']} s", flush=True)
  return result


def _steps(epochs: int) -> dict:
  bench = [sys.executable, "-m", "trainer.bench"]
  loop = bench + ["loop", f"--epochs={epochs}", f"--keras_epochs={epochs}", "--target=1.01",
                  "--json={json}"]
  return {
      "fit": (loop + ["--strategy=default"], 3600),
      "mirrored": (loop + ["--strategy=mirrored"], 3600),
      "per_example": (bench + ["per_example", "--batch_sizes=128",
                               "--methods=batch_gradient,microstep,ghost_statistics",
                               "--json={json}"], 3600),
      "memory": (bench + ["memory", "--json={json}"], 3600),
      "exactness": ([sys.executable, "-m", "pytest", "-q", "tests/test_accumulation.py",
                     "tests/test_accumulation_mechanics.py"], 3600),
  }


def main(argv):
  del argv
  devices = _devices()
  if devices["on"] == "cpu":
    print("no GPU found: running every step on the CPU (figures are CPU figures)", flush=True)
  else:
    print(f"GPUs: {', '.join(devices['gpus'])}", flush=True)
  results = {"devices": devices, "date": time.strftime("%Y-%m-%d"), "steps": []}
  for step, (cmd, timeout_s) in _steps(FLAGS.epochs).items():
    if step not in FLAGS.skip:
      results["steps"].append(_run(step, cmd, timeout_s))
  print(json.dumps(results, indent=1))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(results, f, indent=2)
  return 1 if any(s["exit_code"] for s in results["steps"]) else 0
