"""Tests of launch/tpu_remote.py, the launcher's agent on a TPU VM, with real local processes.

Each test runs the agent as `python launch/tpu_remote.py ...` (under `timeout -k`) in a temporary
runs directory, with a fake trainer: a few lines of Python that log their start, exit 42 on
SIGTERM (as the real trainer does after writing its checkpoint) and otherwise sleep, under
`timeout --preserve-status -k` (which passes SIGTERM on and keeps the trainer's status). Whatever a
test leaves running is ended by the fixture, by the PIDs the agent recorded.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from launch import tpu_remote

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
AGENT = str(REPO_ROOT / "launch" / "tpu_remote.py")


def fake_trainer(starts_file, on_term="raise SystemExit(42)", sleep_s=60, kill_after_s=5):
  """argv of a trainer that appends a line to `starts_file`, prints, and handles SIGTERM."""
  code = (f"import signal, sys, time\n"
          f"def on_term(*_):\n  print('got SIGTERM', flush=True)\n  {on_term}\n"
          f"signal.signal(signal.SIGTERM, on_term)\n"
          f"open({str(starts_file)!r}, 'a').write('started\\n')\n"
          f"print('training step 1', flush=True)\n"
          f"time.sleep({sleep_s})\n")
  return ["timeout", "--preserve-status", "-k", str(kill_after_s), str(sleep_s + 30),
          sys.executable, "-c", code]


def agent(runs_dir, *args, timeout_s=60):
  return subprocess.run(["timeout", "-k", "5", str(timeout_s), sys.executable, AGENT, args[0],
                         f"--runs_dir={runs_dir}", *args[1:]],
                        capture_output=True, text=True, timeout=timeout_s + 10, check=False)


def record(runs_dir):
  path = pathlib.Path(runs_dir) / "trainer.pid"
  return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture
def runs_dir(tmp_path):
  runs = tmp_path / "runs"
  yield runs
  rec = record(runs)
  if rec and tpu_remote._alive(rec):  # pylint: disable=protected-access
    # End what the test left running, by the PIDs the agent recorded.
    for kill in (lambda: os.killpg(rec["pid"], signal.SIGKILL),
                 lambda: os.kill(rec["supervisor"], signal.SIGKILL)):
      try:
        kill()
      except ProcessLookupError:
        pass


def test_start_detaches_the_trainer_and_a_repeat_starts_no_second_copy(runs_dir, tmp_path):
  starts = tmp_path / "starts"
  argv = fake_trainer(starts)
  first = agent(runs_dir, "start", "--run_id=r1", "--", *argv)
  assert first.returncode == 0, first.stdout + first.stderr
  assert "started run r1: trainer pid" in first.stdout
  pid = record(runs_dir)["pid"]
  # What gcloud does when ssh fails: the same command again.
  again = agent(runs_dir, "start", "--run_id=r1", "--", *argv)
  assert again.returncode == 0
  assert "already running" in again.stdout and "not starting a second copy" in again.stdout
  assert record(runs_dir)["pid"] == pid
  time.sleep(1.0)
  assert starts.read_text() == "started\n"
  os.kill(pid, 0)  # Still alive: the agent's own exit did not take it along.


def test_stop_sends_sigterm_and_returns_the_trainers_exit_42(runs_dir, tmp_path):
  start = agent(runs_dir, "start", "--run_id=r1", "--", *fake_trainer(tmp_path / "starts"))
  assert start.returncode == 0, start.stdout + start.stderr
  pid = record(runs_dir)["pid"]
  done = agent(runs_dir, "stop", "--run_id=r1", "--grace_s=20")
  assert done.returncode == 42, done.stdout
  assert f"SIGTERM to trainer pid {pid}" in done.stdout
  assert (runs_dir / "r1.exit").read_text() == "42"
  assert "got SIGTERM" in (runs_dir / "r1.log").read_text()
  assert record(runs_dir) is None
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)
  # Stopping again is harmless and reports the same status; a start of the ended run does nothing.
  assert agent(runs_dir, "stop", "--run_id=r1").returncode == 42
  again = agent(runs_dir, "start", "--run_id=r1", "--", "false")
  assert again.returncode == 0
  assert "run r1 already ended with status 42; not starting it again" in again.stdout
  time.sleep(1.0)
  assert (runs_dir / "r1.exit").read_text() == "42" and record(runs_dir) is None


def test_stop_of_another_run_leaves_the_trainer_alone(runs_dir, tmp_path):
  assert agent(runs_dir, "start", "--run_id=r1", "--",
               *fake_trainer(tmp_path / "starts")).returncode == 0
  pid = record(runs_dir)["pid"]
  other = agent(runs_dir, "stop", "--run_id=r0")
  assert other.returncode == 0 and "not running" in other.stdout
  os.kill(pid, 0)


def test_a_new_run_first_stops_the_leftover_trainer_by_its_pid(runs_dir, tmp_path):
  starts = tmp_path / "starts"
  assert agent(runs_dir, "start", "--run_id=old", "--", *fake_trainer(starts)).returncode == 0
  old_pid = record(runs_dir)["pid"]
  new = agent(runs_dir, "start", "--run_id=new", "--grace_s=20", "--", *fake_trainer(starts))
  assert new.returncode == 0, new.stdout + new.stderr
  assert "leftover trainer of run old" in new.stdout
  assert (runs_dir / "old.exit").read_text() == "42"
  with pytest.raises(ProcessLookupError):
    os.kill(old_pid, 0)
  assert record(runs_dir)["run_id"] == "new" and record(runs_dir)["pid"] != old_pid


def test_a_trainer_that_ignores_sigterm_is_killed_after_the_grace(runs_dir, tmp_path):
  # `timeout` would SIGKILL it 5 s after passing SIGTERM on; give the agent the chance to.
  argv = fake_trainer(tmp_path / "starts", on_term="pass", kill_after_s=60)
  assert agent(runs_dir, "start", "--run_id=r1", "--", *argv).returncode == 0
  pid = record(runs_dir)["pid"]
  began = time.monotonic()
  done = agent(runs_dir, "stop", "--run_id=r1", "--grace_s=2")
  assert "SIGKILL" in done.stdout
  assert done.returncode == 128 + signal.SIGKILL
  assert time.monotonic() - began < 20
  assert (runs_dir / "r1.exit").read_text() == str(128 + signal.SIGKILL)
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)


def test_wait_prints_the_log_and_returns_the_exit_status(runs_dir, tmp_path):
  argv = ["timeout", "-k", "5", "30", sys.executable, "-c",
          "import time; print('step 1', flush=True); time.sleep(1); print('step 2'); "
          "raise SystemExit(7)"]
  assert agent(runs_dir, "start", "--run_id=r1", "--", *argv).returncode == 0
  waited = agent(runs_dir, "wait", "--run_id=r1")
  assert waited.returncode == 7
  assert "step 1" in waited.stdout and "step 2" in waited.stdout
  assert "run r1 ended with status 7" in waited.stdout


def test_wait_for_a_run_that_never_started_fails_with_one_line(runs_dir):
  waited = agent(runs_dir, "wait", "--run_id=ghost", timeout_s=20)
  assert waited.returncode == tpu_remote.LOST_EXIT_CODE
  assert waited.stdout.strip().splitlines() == [
      "error: run ghost is not running and left no exit status"]


def test_env_gets_the_libtpu_directory(monkeypatch, tmp_path):
  class Spec:  # What importlib reports for an installed package.
    submodule_search_locations = [str(tmp_path / "site-packages" / "libtpu")]

  monkeypatch.setattr(tpu_remote.importlib.util, "find_spec",
                      lambda name: Spec() if name == "libtpu" else None)
  env = tpu_remote.resolve_env(["NEXT_PLUGGABLE_DEVICE_USE_C_API=true",
                                "TF_PLUGGABLE_DEVICE_LIBRARY_PATH={libtpu}/libtpu.so"])
  assert env == {"NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
                 "TF_PLUGGABLE_DEVICE_LIBRARY_PATH":
                     str(tmp_path / "site-packages" / "libtpu" / "libtpu.so")}
  monkeypatch.setattr(tpu_remote.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(SystemExit, match="needs the `libtpu` pip package"):
    tpu_remote.resolve_env(["TF_PLUGGABLE_DEVICE_LIBRARY_PATH={libtpu}/libtpu.so"])


def test_the_trainer_gets_the_env(runs_dir, tmp_path):
  out = tmp_path / "env"
  argv = ["timeout", "-k", "5", "30", sys.executable, "-c",
          f"import os; open({str(out)!r}, 'w').write(os.environ['TPU_LOAD_LIBRARY'])"]
  assert agent(runs_dir, "start", "--run_id=r1", "--env=TPU_LOAD_LIBRARY=0", "--",
               *argv).returncode == 0
  assert agent(runs_dir, "wait", "--run_id=r1").returncode == 0
  assert out.read_text() == "0"
