"""Two real processes under MultiWorkerMirroredStrategy on 127.0.0.1 (issue 3).

Each worker runs under `timeout -k 5 240`; the test ends only the PIDs it started.
"""
import contextlib
import glob
import os
import signal
import socket
import subprocess
import sys
import time

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


def run_workers(out_dir, k, optimizer, timeout_s=240, batch_task=""):
  ports = ",".join(map(str, free_ports(2)))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
  procs = [subprocess.Popen(
      ["timeout", "-k", "5", str(timeout_s), sys.executable, os.path.join(HERE, "mwms_worker.py"),
       str(i), ports, str(out_dir), str(k), optimizer] + ([batch_task] if batch_task else []),
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


def test_two_workers_gradcache_equals_the_large_batch(tmp_path):
  """InfoNCE over the whole update of 2 real workers: one all_gather, one all-reduce, exact.

  Momentum SGD, whose update is linear in the gradient: the float32 rounding of the two
  workers' reduction order stays at rounding level (1.5e-8 in the weights). With AdamW at
  lr 0.01 an AVX2 CPU (AMD Zen 3) read 2.2e-6: the gradients agree to ~1e-6 relative, and
  Adam's m / sqrt(v) enlarges that where successive gradients of a coordinate nearly cancel.
  Adam's slots across workers are checked by `test_two_workers_equal_the_large_batch[adamw]`;
  the optimizer step is the same code in both accumulation modes.
  """
  k = 4
  results = run_workers(tmp_path, k, "sgd_momentum", batch_task="contrastive_pairs")
  for name in ("weights", "slots"):
    for a, b in zip(results[0][name], results[1][name]):
      assert np.array_equal(a, b), f"workers disagree on {name}"
  config = helpers.tiny_config(**dict(
      {"accumulation.steps": k, "optimizer.global_clipnorm": 0.3, "optimizer.warmup_steps": 2,
       "optimizer.decay": "cosine", "task": "contrastive_pairs", "accumulation.mode": "gradcache",
       "triplet.embedding_dim": 8},
      **__import__("test_accumulation").OPTIMIZERS["sgd_momentum"]))
  ref_weights, ref_slots = helpers.reference_run(config, list(results[0]["initial"]),
                                                 helpers.update_batches(config, 3))
  assert helpers.max_abs_diff(list(results[0]["weights"]), ref_weights) <= 1e-6
  assert helpers.max_abs_diff(list(results[0]["slots"]), ref_slots) <= 1e-6
  assert int(results[0]["update_reduces"]) == 1
  # Evaluation gathers the representations of both workers before the batch loss: the same
  # numbers as one process evaluating the same weights (a probe found Mirrored(2) scoring each
  # replica's half batch, 2026-12-07; here across processes).
  config.mode = "eval"
  _, trainer, evaluator, _, eval_steps = __import__("trainer.run").run.build(
      config, str(tmp_path / "one_process"))
  for variable, value in zip(trainer.model.trainable_variables, results[0]["weights"]):
    variable.assign(value)
  one = evaluator.evaluate(__import__("tensorflow").constant(eval_steps))
  assert set(one) == {name[len("eval_"):] for name in results[0].files if name.startswith("eval_")}
  assert float(one["examples"]) == 64
  for name, value in one.items():
    for worker in results:
      assert float(worker[f"eval_{name}"]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), name


def _trainer_cmd(workdir, index, ports, *extra, timeout_s=120):
  return (["timeout", "-k", "5", str(timeout_s), sys.executable, "-m", "trainer.main",
           "--config=configs/fashion_mnist.py:smoke,synthetic", f"--workdir={workdir}",
           "--config.strategy=multi_worker_mirrored", "--config.peer_timeout_s=15",
           "--config.mode=train", "--config.steps_per_loop=5", "--config.checkpoint_every=5"]
          + list(extra))


def _worker_env(index, ports):
  tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
               "task": {"type": "worker", "index": index}}
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
              TF_CONFIG=__import__("json").dumps(tf_config))


REPO = os.path.dirname(HERE)


def test_a_worker_whose_peer_never_arrives_exits_with_a_clear_error(tmp_path):
  import time  # pylint: disable=g-import-not-at-top
  from trainer import exit_codes  # pylint: disable=g-import-not-at-top
  ports = free_ports(2)
  start = time.time()
  out = subprocess.run(_trainer_cmd(tmp_path, 0, ports), cwd=REPO, env=_worker_env(0, ports),
                       capture_output=True, text=True, timeout=150, check=False)
  # The watchdog SIGKILLs the stuck constructor (`timeout` then dies of the same signal).
  assert out.returncode in (-9, 128 + 9), out.stderr[-2000:]
  assert time.time() - start < 15 + 30
  assert "microstep: error: not every worker" in out.stderr
  assert "arrived within `peer_timeout_s`=15" in out.stderr
  del exit_codes


@contextlib.contextmanager
def training_workers(tmp_path):
  """Two CLI workers training "forever" (no `timeout` wrapper: the test signals the trainers by
  their own PIDs); yields them once the first checkpoint exists, and kills what still runs."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  ports = free_ports(2)
  logs = [open(tmp_path / f"worker{i}.log", "w+") for i in range(2)]  # pylint: disable=consider-using-with
  procs = [subprocess.Popen(
      [sys.executable] + _trainer_cmd(tmp_path, i, ports, "--config.train_steps=100000")[5:],
      cwd=REPO, env=_worker_env(i, ports), stdout=subprocess.DEVNULL, stderr=logs[i])
           for i in range(2)]
  try:
    deadline = time.time() + 120
    while tf.train.latest_checkpoint(str(tmp_path / "checkpoints")) is None:
      assert time.time() < deadline, "no checkpoint within 120 s"
      assert all(p.poll() is None for p in procs)
      time.sleep(0.5)
    yield procs, logs
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait(timeout=30)
    for log in logs:
      log.close()


def _run_pair(workdirs, ports, *extra, timeout_s=150, name="worker"):
  """Runs two CLI workers (worker i in workdirs[i], stderr in `<name><i>.log` there) to their
  end; returns (exit codes, stderrs)."""
  procs, logs = [], []
  for i, workdir in enumerate(workdirs):
    log = open(os.path.join(workdir, f"{name}{i}.log"), "w+")  # pylint: disable=consider-using-with
    logs.append(log)
    procs.append(subprocess.Popen(_trainer_cmd(workdir, i, ports, *extra, timeout_s=timeout_s),
                                  cwd=REPO, env=_worker_env(i, ports), stdout=subprocess.DEVNULL,
                                  stderr=log))
  try:
    for p in procs:
      p.wait(timeout=timeout_s + 15)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()  # Only the PIDs this test started.
        p.wait(timeout=30)
  errs = []
  for log in logs:
    log.seek(0)
    errs.append(log.read())
    log.close()
  return [p.returncode for p in procs], errs


def test_killed_worker_stops_the_survivor_and_both_resume(tmp_path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import exit_codes  # pylint: disable=g-import-not-at-top
  with training_workers(tmp_path) as (procs, logs):
    procs[1].send_signal(signal.SIGKILL)  # We started it; we end it by its PID.
    killed_at = time.time()
    procs[0].wait(timeout=60)
    logs[0].seek(0)
    err = logs[0].read()
    assert procs[0].returncode == exit_codes.PEER_LOST_EXIT_CODE, err[-2000:]
    assert time.time() - killed_at < 15 + 10
    assert "multi-worker peer stopped answering" in err
  step = int(tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).rsplit("-", 1)[1])
  codes, errs = _run_pair([tmp_path, tmp_path], free_ports(2), f"--config.train_steps={step + 5}",
                          timeout_s=120, name="restart")
  assert codes == [0, 0], errs[0][-1500:] + errs[1][-1500:]
  assert f"at update {step}" in errs[0]
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith(f"ckpt-{step + 5}")


def test_sigterm_to_one_worker_stops_both_with_a_checkpoint(tmp_path):
  """TF's C++ preemption notifier takes SIGTERM over when MultiWorkerMirroredStrategy starts;
  microstep takes it back: the signalled worker and its peer agree, save, and exit 42."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import exit_codes  # pylint: disable=g-import-not-at-top
  with training_workers(tmp_path) as (procs, _):
    procs[1].send_signal(signal.SIGTERM)  # We started it; we signal it by its PID.
    for p in procs:
      p.wait(timeout=60)
  errs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
  assert [p.returncode for p in procs] == [exit_codes.PREEMPTED_EXIT_CODE] * 2, (
      errs[0][-1500:] + errs[1][-1500:])
  steps = {int(e.strip().splitlines()[-1].split("at update ")[1].split(",")[0]) for e in errs}
  assert len(steps) == 1, steps  # Both saved the same update.
  latest = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
  assert latest.endswith(f"ckpt-{steps.pop()}")
  # Only the chief (worker 0) writes TensorBoard events: both did, and every point showed twice.
  # An events file is named events.out.tfevents.<time>.<host>.<pid>.<n>.v2.
  events = glob.glob(str(tmp_path / "summaries" / "*" / "events.out.tfevents.*"))
  assert events and {int(path.split(".")[-3]) for path in events} == {procs[0].pid}, events


def test_workers_that_restored_different_updates_refuse_to_train(tmp_path):
  # Worker 0's workdir holds a checkpoint at update 5; worker 1's (another machine, no shared
  # storage) holds none. Before the check, worker 0's restore broadcast met nothing on worker 1
  # and both crashed (exit 74 and 1, a collective type mismatch); now both exit 2 before any
  # restore, naming the cause.
  from trainer import exit_codes  # pylint: disable=g-import-not-at-top
  shared = tmp_path / "shared"
  shared.mkdir()
  codes, errs = _run_pair([shared, shared], free_ports(2), "--config.train_steps=5")
  assert codes == [0, 0], errs[0][-1500:] + errs[1][-1500:]
  alone = tmp_path / "alone"
  alone.mkdir()
  codes, errs = _run_pair([shared, alone], free_ports(2), "--config.train_steps=10")
  assert codes == [exit_codes.BAD_INPUT_EXIT_CODE] * 2, errs[0][-1500:] + errs[1][-1500:]
  for err, step in zip(errs, ("5", "none")):
    assert ("the workers disagree on the newest checkpoint in their workdirs (this one: "
            f"{step}; another worker has a different one)") in err, err[-1500:]


def test_a_resume_at_an_evaluated_update_skips_it_on_both_workers(tmp_path):
  """An evaluation is collective: the chief decides from its `evaluated.json` whether update 5
  was evaluated already, and tells the other worker, which may not see the chief's files."""
  for steps in (5, 10):
    codes, errs = _run_pair([tmp_path, tmp_path], free_ports(2), "--config.mode=train_and_eval",
                            "--config.eval_every=5", f"--config.train_steps={steps}",
                            name=f"to{steps}_")
    assert codes == [0, 0], errs[0][-1500:] + errs[1][-1500:]
  assert all("update 5 was evaluated already" in err for err in errs), errs[1][-1500:]
  assert helpers.evaluated_updates(tmp_path) == [5, 10]


def test_per_example_statistics_of_two_workers_equal_two_replicas_in_one_process(tmp_path):
  """Statistics on every update (one all-reduce of their sums, one all_gather of the norms)
  across two real workers: the same TensorBoard values as Mirrored(2) in one process. A
  BatchLossTask's evaluation failed only across processes (2026-12-08), so in-process replicas
  do not vouch for collectives."""
  from configs import fashion_mnist  # pylint: disable=g-import-not-at-top
  from trainer import run  # pylint: disable=g-import-not-at-top
  overrides = {"per_example.every_steps": 1, "train_steps": 4, "steps_per_loop": 2,
               "export_at_end": False}
  workers, one = tmp_path / "workers", tmp_path / "one"
  workers.mkdir()
  codes, errs = _run_pair([str(workers)] * 2, free_ports(2),
                          *[f"--config.{name}={value}" for name, value in overrides.items()])
  assert codes == [0, 0], errs[0][-3000:]
  config = fashion_mnist.get_config("smoke,synthetic")
  config.update_from_flattened_dict(dict(overrides, strategy="mirrored", cpu_replicas=2,
                                         mode="train", peer_timeout_s=15))
  run.run(config, str(one))
  across = helpers.summary_events(workers / "summaries" / "train")
  within = helpers.summary_events(one / "summaries" / "train")
  tags = sorted(tag for tag in within if tag.startswith("per_example/"))
  assert len(tags) >= 8 and all(len(within[tag]) == 4 for tag in tags), tags
  for tag in tags:
    assert [step for step, _ in across[tag]] == [step for step, _ in within[tag]], tag
    for (_, a), (_, b) in zip(across[tag], within[tag]):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=tag)
