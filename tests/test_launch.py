"""Tests of the launchers in launch/: their dry-run commands, flag errors and process handling.

Most tests run `python -m launch.X --dry_run` (no TensorFlow is imported there: well under a
second each) or call the launchers' functions with fake commands (`sh -c 'exit 42'`). The one
`slow` test really trains: two local workers of a multi-worker job. The TPU launcher has its own
files: tests/test_tpu_vm.py, tests/test_tpu_runtime.py, tests/test_tpu_remote.py.
"""
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

import pytest

from launch import common
from launch import multi_worker
from launch import single_machine
from trainer import exit_codes

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = sys.executable
CONFIG = "configs/fashion_mnist.py"


def launcher(name, *args, env=None, timeout=60):
  """Runs `python -m launch.NAME ARGS` from the repo root."""
  environ = dict(os.environ)
  environ.pop("CUDA_VISIBLE_DEVICES", None)
  environ.update(env or {})
  return subprocess.run([PY, "-m", f"launch.{name}", *args], cwd=REPO_ROOT, env=environ,
                        capture_output=True, text=True, timeout=timeout, check=False)


def dry_run_lines(name, *args, **kwargs):
  done = launcher(name, *args, "--dry_run", **kwargs)
  assert done.returncode == 0, done.stderr
  return done.stdout.splitlines()


def assert_one_line_error(done, *needles):
  assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
  assert done.stdout == ""
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1, done.stderr
  assert lines[0].startswith("error: "), lines[0]
  for needle in needles:
    assert needle in lines[0], (needle, lines[0])


def test_exit_codes_are_distinct_and_fixed():
  assert exit_codes.PREEMPTED_EXIT_CODE == 42
  assert exit_codes.PEER_LOST_EXIT_CODE == 43
  assert set(common.RESTART_CODES) == {42, 43}


# --- launch.single_machine -----------------------------------------------------------------------


def test_single_machine_two_gpus_adds_mirrored_strategy():
  lines = dry_run_lines("single_machine", f"--config={CONFIG}", "--workdir=/tmp/fm run",
                        "--gpus=2", "--override=batch_size=64", "--override", "optimizer.name=sgd")
  assert lines == [
      f"CUDA_VISIBLE_DEVICES=0,1 {shlex.quote(PY)} -m trainer.main --config={CONFIG} "
      "'--workdir=/tmp/fm run' --config.strategy=mirrored --config.batch_size=64 "
      "--config.optimizer.name=sgd"]


@pytest.mark.parametrize("gpus, environ, devices, strategy", [
    (0, {}, "", None),
    (1, {}, "0", "one_device"),
    (3, {}, "0,1,2", "mirrored"),
    (2, {"CUDA_VISIBLE_DEVICES": "3,5,7"}, "3,5", "mirrored"),
])
def test_single_machine_gpu_count_picks_devices_and_strategy(gpus, environ, devices, strategy):
  cmd = single_machine.build_command(CONFIG, "/tmp/w", gpus, python="python", environ=environ)
  assert dict(cmd.env) == {"CUDA_VISIBLE_DEVICES": devices}
  strategies = [a for a in cmd.argv if a.startswith("--config.strategy=")]
  assert strategies == ([f"--config.strategy={strategy}"] if strategy else [])
  assert cmd.argv[:5] == ("python", "-m", "trainer.main", f"--config={CONFIG}", "--workdir=/tmp/w")


def test_single_machine_cpu_keeps_user_strategy():
  cmd = single_machine.build_command(CONFIG, "/w", 0, ["strategy=mirrored", "cpu_replicas=2"],
                                     python="python", environ={})
  assert cmd.shell() == ("CUDA_VISIBLE_DEVICES='' python -m trainer.main "
                         f"--config={CONFIG} --workdir=/w --config.strategy=mirrored "
                         "--config.cpu_replicas=2")


@pytest.mark.parametrize("args, env, needles", [
    (["--gpus=-1"], {}, ["--gpus=-1", "allowed"]),
    (["--gpus=2", "--override=strategy=tpu"], {}, ["--override=strategy=tpu", "mirrored"]),
    (["--override=batch_size"], {}, ["--override='batch_size'", "FIELD=VALUE"]),
    (["--gpus=3"], {"CUDA_VISIBLE_DEVICES": "0,1"}, ["--gpus=3", "allowed: --gpus <= 2"]),
    (["--max_restarts=-1"], {}, ["--max_restarts=-1", "allowed"]),
    # Values absl cannot parse, and an unknown flag: absl's two lines and exit 1 until a probe.
    (["--gpus=abc"], {}, ["flag --gpus=abc: invalid literal for int()"]),
    (["--max_restarts=1.5"], {}, ["flag --max_restarts=1.5"]),
    (["--bogus=1"], {}, ["Unknown command line flag 'bogus'"]),
])
def test_single_machine_invalid_flags_fail_with_one_line(args, env, needles):
  done = launcher("single_machine", f"--config={CONFIG}", "--workdir=/tmp/w", *args,
                  "--dry_run", env=env)
  assert_one_line_error(done, *needles)


@pytest.mark.parametrize("command, needle", [
    ("launch.single_machine --help", "--workdir"), ("launch.multi_worker -?", "--workdir"),
    ("trainer.main --help", "--workdir"), ("trainer.main --helpfull", "--workdir"),
    # A benchmark's own flags: absl's help described the dispatcher (none of them), and exit 1.
    ("trainer.bench statistics_cost --help", "--updates:"),
    ("trainer.bench loop --helpfull", "--keras_epochs:")])
def test_asking_for_help_prints_it_and_exits_0(command, needle):
  """absl's help flags exit 1 after printing; asked-for help is a success (a probe, 2026-12-07)."""
  done = subprocess.run([PY, "-m", *command.split()], cwd=REPO_ROOT, capture_output=True,
                        text=True, timeout=60, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert needle in done.stdout


def test_single_machine_missing_workdir_and_config_file():
  assert_one_line_error(launcher("single_machine", f"--config={CONFIG}", "--dry_run"),
                        "--workdir is required")
  assert_one_line_error(
      launcher("single_machine", "--config=configs/nope.py:smoke", "--workdir=/w", "--dry_run"),
      "--config=configs/nope.py:smoke", "configs/nope.py")


def _counting_command(tmp_path, codes):
  """A command that exits with codes[n] on its n-th run (counted in a file)."""
  counter = tmp_path / "runs"
  script = (f"import pathlib; p = pathlib.Path({str(counter)!r}); "
            "n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1)); "
            f"raise SystemExit({list(codes)!r}[n])")
  return common.command(PY, "-c", script), counter


def test_single_machine_restarts_while_preempted(tmp_path):
  cmd, counter = _counting_command(tmp_path, [42, 43, 0])
  assert single_machine.launch(cmd, max_restarts=3) == 0
  assert counter.read_text() == "3"


@pytest.mark.parametrize("code", [2, 3, 74, 130])
def test_single_machine_never_restarts_a_stop_a_person_must_read(tmp_path, code):
  cmd, counter = _counting_command(tmp_path, [code, 0])
  assert single_machine.launch(cmd, max_restarts=3) == code
  assert counter.read_text() == "1"


def test_single_machine_restarts_are_bounded(tmp_path):
  cmd, counter = _counting_command(tmp_path, [42, 42, 42, 0])
  assert single_machine.launch(cmd, max_restarts=1) == 42
  assert counter.read_text() == "2"


@pytest.mark.parametrize("launch_call", [
    "single_machine.launch(cmd, max_restarts=3)",
    "common.supervise([cmd, common.command(*cmd.argv[:2], cmd.argv[2].replace('ready', 'r2'))])",
])
def test_a_sigterm_to_the_launcher_ends_with_the_trainers_own_status(tmp_path, launch_call):
  """The trainer checkpoints on the SIGTERM passed on and exits 42; the launcher exited 143 (its
  own death by SIGTERM) where docs/launch.md says it exits with the trainer's status (a probe,
  2026-12-07). The child here stands in for the trainer."""
  ready = tmp_path / "ready"
  child = ("import pathlib, signal, sys, time\n"
           "signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))\n"
           f"pathlib.Path({str(ready)!r}).write_text('up')\n"
           "time.sleep(60)\n")
  parent = ("import sys\nfrom launch import common, single_machine\n"
            f"cmd = common.command({PY!r}, '-c', {child!r})\n"
            f"sys.exit({launch_call})\n")
  proc = subprocess.Popen(["timeout", "-k", "5", "60", PY, "-c", parent], cwd=REPO_ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  started = [ready] + ([tmp_path / "r2"] if "supervise" in launch_call else [])
  deadline = time.monotonic() + 30
  while (not all(p.exists() for p in started) and time.monotonic() < deadline
         and proc.poll() is None):
    time.sleep(0.05)
  assert all(p.exists() for p in started), (
      proc.stderr.read() if proc.poll() is not None else "a child never started")
  os.kill(proc.pid, signal.SIGTERM)  # timeout(1) passes it on to the launcher.
  _, err = proc.communicate(timeout=40)
  assert proc.returncode == 42, err
  assert "launcher got SIGTERM; stopping its processes, no restart" in err


def test_single_machine_never_restarts_a_crash(tmp_path):
  cmd, counter = _counting_command(tmp_path, [1, 0])
  assert single_machine.launch(cmd, max_restarts=3) == 1
  assert counter.read_text() == "1"


# --- launch.multi_worker -------------------------------------------------------------------------


def test_multi_worker_local_dry_run_writes_one_tf_config_per_worker():
  workdir = "/tmp/mw"
  lines = dry_run_lines("multi_worker", "--local=2", f"--config={CONFIG}:smoke,synthetic",
                        f"--workdir={workdir}", "--timeout_s=240", "--override=seed=3")
  assert len(lines) == 2
  clusters = []
  for index, line in enumerate(lines):
    words = shlex.split(line)
    assert words[0] == "CUDA_VISIBLE_DEVICES="
    name, _, value = words[1].partition("=")
    assert name == "TF_CONFIG"
    config = json.loads(value)
    assert config["task"] == {"type": "worker", "index": index}
    clusters.append(config["cluster"])
    assert words[2:] == ["timeout", "-k", "30", "240", PY, "-m", "trainer.main",
                         f"--config={CONFIG}:smoke,synthetic", f"--workdir={workdir}",
                         "--config.strategy=multi_worker_mirrored", "--config.seed=3"]
  assert clusters[0] == clusters[1]
  workers = clusters[0]["worker"]
  assert list(clusters[0]) == ["worker"] and len(workers) == 2 and len(set(workers)) == 2
  for worker in workers:
    host, port = worker.split(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536


def test_multi_worker_remote_dry_run_is_one_ssh_per_host():
  lines = dry_run_lines("multi_worker", "--hosts=h1:2222,10.0.0.3:2223", f"--config={CONFIG}",
                        "--workdir=gs://bucket/run", "--remote_dir=/srv/micro step")
  expected = []
  for index, host in enumerate(["h1", "10.0.0.3"]):
    tf_config = ('{"cluster":{"worker":["h1:2222","10.0.0.3:2223"]},'
                 f'"task":{{"type":"worker","index":{index}}}}}')
    remote = (f"cd '/srv/micro step' && TF_CONFIG='{tf_config}' python3 -m trainer.main "
              f"--config={CONFIG} --workdir=gs://bucket/run "
              "--config.strategy=multi_worker_mirrored")
    assert shlex.split(lines[index]) == ["ssh", host, remote]
    expected.append(shlex.join(["ssh", host, remote]))
  assert lines == expected


def test_multi_worker_tf_config_json():
  assert json.loads(multi_worker.tf_config(["a:1", "b:2", "c:3"], 2)) == {
      "cluster": {"worker": ["a:1", "b:2", "c:3"]}, "task": {"type": "worker", "index": 2}}


@pytest.mark.parametrize("args, needles", [
    ([], ["exactly one of --hosts", "--local=N"]),
    (["--local=2", "--hosts=a:1,b:2"], ["exactly one of --hosts"]),
    (["--hosts=h1,h2:2222"], ["--hosts entry 'h1'", "host:port"]),
    (["--hosts=h1:70000"], ["--hosts entry 'h1:70000'", "1..65535"]),
    (["--hosts=h1:1,h1:1"], ["twice"]),
    (["--local=-2"], ["--local=-2", "allowed"]),
    (["--local=2", "--timeout_s=0"], ["--timeout_s=0", "allowed"]),
    (["--local=2", "--timeout_s=1m"], ["flag --timeout_s=1m: invalid literal for int()"]),
    (["--local=2", "--override=strategy=mirrored"],
     ["--override=strategy=mirrored", "multi_worker_mirrored"]),
])
def test_multi_worker_invalid_flags_fail_with_one_line(args, needles):
  done = launcher("multi_worker", f"--config={CONFIG}", "--workdir=/tmp/w", *args, "--dry_run")
  assert_one_line_error(done, *needles)


def test_supervise_stops_the_other_workers_when_one_fails(tmp_path):
  pid_file = tmp_path / "pid"
  sleeper = common.command("sh", "-c", f"echo $$ > {shlex.quote(str(pid_file))}; exec sleep 60")
  failing = common.command("sh", "-c", "sleep 0.5; exit 3")
  start = time.monotonic()
  assert common.supervise([sleeper, failing], grace_s=5) == 3
  assert time.monotonic() - start < 4  # SIGTERM, not the SIGKILL after grace_s.
  pid = int(pid_file.read_text())
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)


def test_supervise_waits_for_all_and_prefers_a_real_crash():
  ok = [common.command("sh", "-c", f"sleep {s}; exit 0") for s in (0.1, 0.6)]
  assert common.supervise(ok) == 0
  both = [common.command("sh", "-c", "sleep 0.3; exit 43"),
          common.command("sh", "-c", "sleep 0.3; exit 1")]
  assert common.supervise(both, poll_s=1.0) == 1


def test_restart_loop_restarts_on_peer_lost_and_preempted_only():
  for codes, max_restarts, result, calls in [([43, 42, 0], 3, 0, 3), ([43, 43, 43], 1, 43, 2),
                                              ([1, 0], 3, 1, 1), ([0], 0, 0, 1)]:
    seen = []

    def attempt(n, codes=codes, seen=seen):
      seen.append(n)
      return codes[n]

    assert common.run_with_restarts(attempt, max_restarts, "job") == result
    assert seen == list(range(calls))


@pytest.mark.slow
def test_local_multi_worker_really_trains(tmp_path):
  """Two real workers on 127.0.0.1 train the smoke recipe and leave a checkpoint."""
  assert (REPO_ROOT / "trainer" / "main.py").is_file(), "trainer/main.py is not written yet"
  workdir = tmp_path / "run"
  done = launcher("multi_worker", "--local=2", f"--config={CONFIG}:smoke,synthetic",
                  f"--workdir={workdir}", "--timeout_s=240", "--max_restarts=0", timeout=300)
  assert done.returncode == 0, done.stderr[-4000:]
  checkpoints = workdir / "checkpoints"
  names = [p.name for p in checkpoints.rglob("*")] if checkpoints.is_dir() else []
  assert any(n == "checkpoint" or n.startswith("ckpt-") for n in names), names


@pytest.mark.parametrize("tf_config,key", [
    ({"cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"]}, "task": {"type": "chief", "index": 0}}, ""),
    ({"cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"]}, "task": {"type": "worker", "index": 0}},
     "worker_0"),
    ({"cluster": {"worker": ["b:1", "c:1"]}, "task": {"type": "worker", "index": 0}}, ""),
    ({"cluster": {"worker": ["b:1", "c:1"]}, "task": {"type": "worker", "index": 1}}, "worker_1"),
])
def test_the_chief_holds_the_workdirs_main_lock(monkeypatch, tf_config, key):
  """A plain run and a multi-worker chief contend for the same `.lock`; other workers have theirs."""
  import json  # pylint: disable=g-import-not-at-top
  from trainer import config_defaults, strategies  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
  config = config_defaults.base_config()
  config.strategy = "multi_worker_mirrored"
  assert strategies.task_key(config) == key
