"""Two real processes under MultiWorkerMirroredStrategy on 127.0.0.1 (issue 3).

Each worker runs under `timeout -k 5 240`; the test ends only the PIDs it started.
"""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import helpers

HERE = os.path.dirname(os.path.abspath(__file__))


def free_ports(count):
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


def run_workers(out_dir, k, optimizer, timeout_s=240):
  ports = ",".join(map(str, free_ports(2)))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
  procs = [subprocess.Popen(
      ["timeout", "-k", "5", str(timeout_s), sys.executable, os.path.join(HERE, "mwms_worker.py"),
       str(i), ports, str(out_dir), str(k), optimizer],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=timeout_s + 15)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  return [np.load(os.path.join(out_dir, f"worker{i}.npz"), allow_pickle=True) for i in range(2)]


@pytest.mark.parametrize("opt", ["sgd_momentum", "adamw"])
def test_two_workers_equal_the_large_batch(tmp_path, opt):
  k = 4
  results = run_workers(tmp_path, k, opt)
  for name in ("weights", "slots"):
    for a, b in zip(results[0][name], results[1][name]):
      assert np.array_equal(a, b), f"workers disagree on {name}"
  assert int(results[0]["iterations"]) == 3
  config = helpers.tiny_config(**dict(
      {"accumulation.steps": k, "optimizer.global_clipnorm": 0.3, "optimizer.warmup_steps": 2,
       "optimizer.decay": "cosine"}, **__import__("test_accumulation").OPTIMIZERS[opt]))
  ref_weights, ref_slots = helpers.reference_run(config, list(results[0]["initial"]),
                                                 helpers.update_batches(config, 3))
  assert helpers.max_abs_diff(list(results[0]["weights"]), ref_weights) <= 1e-6
  assert helpers.max_abs_diff(list(results[0]["slots"]), ref_slots) <= 1e-6
  # One collective reduction per update (the packed vector), none in the micro-steps.
  assert int(results[0]["update_reduces"]) == 1
  assert int(results[0]["micro_reduces"]) == 0
