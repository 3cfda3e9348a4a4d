"""The launcher's agent on a TPU VM: at most one detached trainer per VM, under a pidfile.

`launch.tpu_vm` drives a TPU VM with `gcloud compute tpus tpu-vm ssh --command=...`, which has two
traps. gcloud runs the whole command again (up to 10 times, 5 s apart) when ssh itself fails,
and a signal to the local gcloud never reaches the remote process (no tty is allocated). So the
trainer lives apart from every ssh session, and each remote action is a short command that is
safe to repeat:

  start --run_id=R [--env=K=V ...] -- ARGV   Stops a leftover trainer of another run by its PID,
                                            then starts ARGV detached. Repeated with the same R
                                            it finds that run running or ended and does nothing,
                                            so a retry by gcloud never starts a second copy.
  wait --run_id=R                           Prints the run's log as it grows and exits with the
                                            trainer's exit status once it has ended.
  stop --run_id=R [--grace_s=S]             SIGTERM to the trainer's PID; waits up to S seconds
                                            for its exit (42: checkpoint written), then SIGKILL.
  check --tpu=local|NAME [--env=K=V ...]    The install check: TensorFlow must see TPU devices
                                            (`tf.config.list_logical_devices('TPU')` non-empty).

Files, in --runs_dir (default `runs`, inside the repo copy on the VM):

  trainer.pid  JSON {"run_id", "pid", "start", "supervisor"}: the run that owns this VM's trainer.
  R.log        the trainer's stdout and stderr.      R.exit  its exit status, once it has ended.
  lock         held (flock) while start and stop decide, so that two of them never interleave.

`start` hands ARGV to a small detached supervisor (this file's `supervise`), which starts the
trainer, writes the pidfile (with the process start time, so a reused PID is never mistaken for
the trainer), passes SIGTERM on to the trainer and writes R.exit. In `--env`, `{libtpu}` stands for
the directory of the installed `libtpu` pip package.

Only the standard library is used, so this works before the pip install; TensorFlow is imported
by `check` alone. Every wait below has a deadline or ends with the process it watches.
"""
import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

CHECK_FAILED_EXIT_CODE = 3   # `check`: TensorFlow sees no TPU.
LOST_EXIT_CODE = 1           # `wait`: the run vanished without an exit status (e.g. VM reboot).
KILLED_EXIT_CODE = 128 + signal.SIGKILL
STOP_GRACE_S = 600.0         # Time to checkpoint after SIGTERM, before SIGKILL.
START_TIMEOUT_S = 30.0       # For the supervisor to write the pidfile.
POLL_S = 2.0
LOG_TAIL_BYTES = 16384       # How much of an existing log `wait` shows when it (re)attaches.


# --- Files and processes. -----------------------------------------------------------------------


def _start_ticks(pid: int):
  """The process's start time in clock ticks (field 22 of /proc/PID/stat); None when it is gone
  or a zombie. Together with the PID it names one process for good."""
  try:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  fields = stat[stat.rindex(")") + 2:].split()  # Fields 3.. (the name may contain spaces).
  return None if fields[0] == "Z" else int(fields[19])


def _alive(record) -> bool:
  return bool(record) and _start_ticks(record["pid"]) == record["start"]


def _write_atomically(path: pathlib.Path, text: str) -> None:
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


class Runs:
  """The runs directory of one VM."""

  def __init__(self, runs_dir: str):
    self.dir = pathlib.Path(runs_dir).expanduser()
    self.dir.mkdir(parents=True, exist_ok=True)
    self.pidfile = self.dir / "trainer.pid"

  def log(self, run_id: str) -> pathlib.Path:
    return self.dir / f"{run_id}.log"

  def record(self):
    """The pidfile's content, or None."""
    try:
      return json.loads(self.pidfile.read_text())
    except (OSError, ValueError):
      return None

  def exit_status(self, run_id: str):
    try:
      return int((self.dir / f"{run_id}.exit").read_text())
    except (OSError, ValueError):
      return None

  @contextlib.contextmanager
  def locked(self):
    with open(self.dir / "lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      yield


def resolve_env(items) -> dict:
  """`K=V` strings -> {K: V}, with `{libtpu}` replaced by the installed libtpu package's path."""
  env = {}
  for item in items:
    name, _, value = item.partition("=")
    if "{libtpu}" in value:
      spec = importlib.util.find_spec("libtpu")
      if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: --env={item} needs the `libtpu` pip package, which is not "
                         "installed; allowed: run the launcher's install step first")
      value = value.replace("{libtpu}", list(spec.submodule_search_locations)[0])
    env[name] = value
  return env


def _wait_until(predicate, timeout_s: float, poll_s: float = 0.2) -> bool:
  deadline = time.monotonic() + timeout_s
  while not predicate():
    if time.monotonic() >= deadline:
      return False
    time.sleep(poll_s)
  return True


def _stop_trainer(runs: Runs, record, grace_s: float) -> int:
  """SIGTERM to the trainer, SIGKILL after `grace_s`; returns its exit status."""
  pid, run_id = record["pid"], record["run_id"]
  print(f"stopping run {run_id}: SIGTERM to trainer pid {pid}", flush=True)
  with contextlib.suppress(ProcessLookupError):
    os.kill(pid, signal.SIGTERM)
  if not _wait_until(lambda: not _alive(record), grace_s, poll_s=0.5):
    print(f"trainer pid {pid} still running after {grace_s:.0f}s; SIGKILL", flush=True)
    with contextlib.suppress(ProcessLookupError):
      os.killpg(pid, signal.SIGKILL)  # Its process group: the trainer and its own children.
    _wait_until(lambda: not _alive(record), 10.0)
  # The supervisor writes the status right after its trainer has exited.
  _wait_until(lambda: runs.exit_status(run_id) is not None, 10.0)
  code = runs.exit_status(run_id)
  return KILLED_EXIT_CODE if code is None else code


# --- The commands. ------------------------------------------------------------------------------


def start(runs: Runs, run_id: str, argv, env_items, grace_s: float = STOP_GRACE_S) -> int:
  """Starts `argv` detached as run `run_id` unless that run already exists (see module doc)."""
  if not argv:
    raise SystemExit("error: start needs the trainer command after `--`")
  env = dict(os.environ, **resolve_env(env_items))
  with runs.locked():
    record = runs.record()
    if _alive(record):
      if record["run_id"] == run_id:
        print(f"run {run_id} is already running (trainer pid {record['pid']}); not starting a "
              "second copy", flush=True)
        return 0
      print(f"a leftover trainer of run {record['run_id']} holds this VM", flush=True)
      _stop_trainer(runs, record, grace_s)
    if runs.exit_status(run_id) is not None:
      print(f"run {run_id} already ended with status {runs.exit_status(run_id)}; not starting "
            "it again", flush=True)
      return 0
    with open(runs.log(run_id), "ab") as log:
      subprocess.Popen(  # Detached: its own session, no ssh stdin/stdout, reaped by init.
          [sys.executable, os.path.abspath(__file__), "supervise", f"--runs_dir={runs.dir}",
           f"--run_id={run_id}", "--", *argv],
          env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
          start_new_session=True)
    seen = {}
    started = _wait_until(
        lambda: seen.update(runs.record() or {}) or seen.get("run_id") == run_id, START_TIMEOUT_S)
  if not started:
    print(f"error: run {run_id} did not start within {START_TIMEOUT_S:.0f}s; see "
          f"{runs.log(run_id)}", flush=True)
    return 1
  print(f"started run {run_id}: trainer pid {seen['pid']}, log {runs.log(run_id)}", flush=True)
  return 0


def supervise(runs: Runs, run_id: str, argv) -> int:
  """Runs the trainer, records it in the pidfile, passes SIGTERM on, writes R.exit.

  The trainer gets a session (and process group) of its own, so that a SIGKILL can take its
  children along (`_stop_trainer`), while SIGTERM goes to the trainer alone.
  """
  trainer = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
  def forward(signum, frame):
    del signum, frame
    trainer.send_signal(signal.SIGTERM)

  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)
  signal.signal(signal.SIGHUP, signal.SIG_IGN)
  _write_atomically(runs.pidfile, json.dumps({
      "run_id": run_id, "pid": trainer.pid, "start": _start_ticks(trainer.pid),
      "supervisor": os.getpid()}))
  code = trainer.wait()
  status = 128 - code if code < 0 else code
  _write_atomically(runs.dir / f"{run_id}.exit", str(status))
  with runs.locked():
    if (runs.record() or {}).get("run_id") == run_id:
      runs.pidfile.unlink()
  return status


def stop(runs: Runs, run_id: str, grace_s: float = STOP_GRACE_S) -> int:
  """Stops run `run_id` (never another run); returns the trainer's exit status."""
  with runs.locked():
    record = runs.record()
    if _alive(record) and record["run_id"] == run_id:
      return _stop_trainer(runs, record, grace_s)
  code = runs.exit_status(run_id)
  if code is None:
    print(f"run {run_id} is not running on this VM", flush=True)
    return 0
  print(f"run {run_id} already ended with status {code}", flush=True)
  return code


def wait(runs: Runs, run_id: str, poll_s: float = POLL_S, out=None) -> int:
  """Follows the run's log until it ends; returns its exit status."""
  out = out or sys.stdout.buffer
  log = runs.log(run_id)
  offset = max(0, log.stat().st_size - LOG_TAIL_BYTES) if log.exists() else 0

  def copy_new_output():
    nonlocal offset
    if log.exists():
      with open(log, "rb") as f:
        f.seek(offset)
        chunk = f.read()
      offset += len(chunk)
      out.write(chunk)
      out.flush()

  while True:  # Ends with the run: its status appears, or its processes are gone.
    copy_new_output()
    code = runs.exit_status(run_id)
    record = runs.record()
    if code is None and not (_alive(record) and record["run_id"] == run_id):
      time.sleep(0.5)  # The supervisor may be writing the status right now.
      code = runs.exit_status(run_id)
      if code is None:
        print(f"error: run {run_id} is not running and left no exit status", flush=True)
        return LOST_EXIT_CODE
    if code is not None:
      copy_new_output()
      print(f"run {run_id} ended with status {code}", flush=True)
      return code
    time.sleep(poll_s)


def check(tpu: str, env_items) -> int:
  """The install check, in the environment the trainer will get."""
  os.environ.update(resolve_env(env_items))
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
    if tpu != "local":
      tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    devices = tf.config.list_logical_devices("TPU")
  except Exception as e:  # pylint: disable=broad-except
    first_line = (str(e).strip().splitlines() or [""])[0]
    print(f"error: install check failed on --tpu={tpu}: {type(e).__name__}: {first_line}",
          flush=True)
    return CHECK_FAILED_EXIT_CODE
  if not devices:
    print(f"error: install check failed on --tpu={tpu}: tf.config.list_logical_devices('TPU') "
          f"is empty (TensorFlow {tf.__version__})", flush=True)
    return CHECK_FAILED_EXIT_CODE
  print(f"install check passed: TensorFlow {tf.__version__} sees {len(devices)} TPU devices",
        flush=True)
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)
  for name in ("start", "supervise", "stop", "wait", "check"):
    sub = commands.add_parser(name)
    sub.add_argument("--runs_dir", default="runs")
    if name == "check":
      sub.add_argument("--tpu", required=True)
    else:
      sub.add_argument("--run_id", required=True)
    if name in ("start", "check"):
      sub.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    if name in ("start", "stop"):
      sub.add_argument("--grace_s", type=float, default=STOP_GRACE_S)
    if name in ("start", "supervise"):
      sub.add_argument("argv", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  if args.command == "check":
    return check(args.tpu, args.env)
  runs = Runs(args.runs_dir)
  trainer_argv = [a for i, a in enumerate(getattr(args, "argv", [])) if i or a != "--"]
  if args.command == "start":
    return start(runs, args.run_id, trainer_argv, args.env, args.grace_s)
  if args.command == "supervise":
    return supervise(runs, args.run_id, trainer_argv)
  if args.command == "stop":
    return stop(runs, args.run_id, args.grace_s)
  return wait(runs, args.run_id)


if __name__ == "__main__":
  sys.exit(main())
