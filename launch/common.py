"""What the three launchers share: commands, shell quoting, running, supervising, restarting.

A launcher only *builds* command lines and hands them to the helpers below, so every launcher gets
the same behaviour for free:

  * `Command.shell()` renders a command exactly as `--dry_run` prints it: `VAR=value` prefixes for
    the extra environment, then the argv quoted with `shlex.join`, so each printed line can be
    pasted into a POSIX shell and runs the same thing.
  * `run()` runs one command in the foreground; `supervise()` runs several side by side and stops
    the rest as soon as one fails. Both end only the processes they started, by PID. A SIGTERM to
    the launcher reaches those local processes only: a process they start on another machine
    (ssh, gcloud) never sees it, which is why launch/tpu_vm.py sends its own remote stop, run
    with `run_to_end()` so that a second signal cannot cut it short.
  * `run_with_restarts()` is the bounded restart loop: it repeats an attempt while it exits with a
    code that means "restart me" (`trainer.exit_codes`), at most `max_restarts` times.

User errors are raised as `LaunchError` with a one-line message naming the flag and what is
allowed; `run_main()` prints that line and exits with status 2. Progress messages go to stderr, so
stdout of a dry run holds the commands and nothing else.

Nothing here imports TensorFlow: launching must work on a laptop that only has gcloud or ssh.
"""
import dataclasses
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Iterable, Mapping, Sequence

from absl import app
from absl import flags

from trainer import exit_codes
from trainer import flag_errors

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
TRAINER_MODULE = "trainer.main"
# How long a process gets to exit after SIGTERM (a trainer writes its checkpoint then) before
# SIGKILL.
TERM_GRACE_S = 30.0
# Exit codes after which a whole job is started again (it resumes from its checkpoint).
RESTART_CODES = (exit_codes.PREEMPTED_EXIT_CODE, exit_codes.PEER_LOST_EXIT_CODE)
_CODE_NAMES = {
    exit_codes.PREEMPTED_EXIT_CODE: "preempted, checkpoint written",
    exit_codes.PEER_LOST_EXIT_CODE: "multi-worker peer lost",
    124: "timed out",
}
_FIELD_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class LaunchError(Exception):
  """A user error; its message is one line that names the flag and the allowed values."""


@dataclasses.dataclass(frozen=True)
class Command:
  """One process to start: its argv plus environment variables set on top of ours."""
  argv: tuple[str, ...]
  env: tuple[tuple[str, str], ...] = ()

  def shell(self) -> str:
    """The command as one POSIX shell line, e.g. `TF_CONFIG='{...}' python -m trainer.main ...`."""
    prefix = [f"{name}={shlex.quote(value)}" for name, value in self.env]
    return " ".join(prefix + [shlex.join(self.argv)])


def command(*argv: str, env: Mapping[str, str] | None = None) -> Command:
  return Command(tuple(str(a) for a in argv), tuple((env or {}).items()))


def log(message: str) -> None:
  print(f"[launch] {message}", file=sys.stderr, flush=True)


def describe_exit(code: int) -> str:
  name = _CODE_NAMES.get(code)
  return f"{code} ({name})" if name else str(code)


# --- Building trainer command lines. -------------------------------------------------------------


def parse_overrides(overrides: Iterable[str], flag: str = "--override") -> list[tuple[str, str]]:
  """Splits `FIELD=VALUE` strings (FIELD may be dotted, e.g. `optimizer.learning_rate`)."""
  parsed = []
  for item in overrides:
    field, sep, value = item.partition("=")
    field = field.strip()
    if field.startswith("config."):
      field = field[len("config."):]
    if not sep or not _FIELD_RE.match(field):
      raise LaunchError(
          f"{flag}={item!r} is invalid; expected FIELD=VALUE, e.g. {flag}=batch_size=64")
    parsed.append((field, value))
  return parsed


def merge_settings(fixed: Mapping[str, str], overrides: Sequence[tuple[str, str]],
                   reason: str) -> list[tuple[str, str]]:
  """Launcher-set config fields followed by the user's overrides; refuses to let them collide."""
  for field, value in overrides:
    if field in fixed:
      raise LaunchError(
          f"--override={field}={value} conflicts with the launcher, which sets "
          f"config.{field}={fixed[field]} {reason}; drop the override")
  return list(fixed.items()) + list(overrides)


def trainer_argv(python: str, config: str, workdir: str,
                 settings: Sequence[tuple[str, str]]) -> list[str]:
  """`python -m trainer.main --config=... --workdir=... --config.F=V ...`."""
  argv = [python, "-m", TRAINER_MODULE, f"--config={config}", f"--workdir={workdir}"]
  argv += [f"--config.{field}={value}" for field, value in settings]
  return argv


def check_required(**flag_values) -> None:
  for name, value in flag_values.items():
    if value is None or value == "":
      raise LaunchError(f"--{name} is required")


def check_config_file(config: str) -> None:
  """`--config=configs/x.py[:args]` must name a file that exists (relative to the repo root)."""
  path = config.split(":", 1)[0]
  if not (pathlib.Path(path).is_file() or (REPO_ROOT / path).is_file()):
    raise LaunchError(f"--config={config}: no file {path!r}; pass a recipe such as "
                      "configs/fashion_mnist.py[:smoke]")


def check_non_negative(name: str, value: int) -> None:
  if value < 0:
    raise LaunchError(f"--{name}={value} is invalid; allowed: an integer >= 0")


def remote_path(path: str) -> str:
  """Shell-quotes a path for a remote shell, keeping a leading `~/` so that it still expands."""
  if path == "~":
    return "~"
  if path.startswith("~/"):
    return "~/" + shlex.quote(path[2:])
  return shlex.quote(path)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
  """`count` distinct free TCP ports, found by binding port 0 (all held open until all are read)."""
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind((host, 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def print_commands(commands: Iterable[Command], out=None) -> None:
  out = out or sys.stdout
  for cmd in commands:
    print(cmd.shell(), file=out)
  out.flush()


# --- Running processes. --------------------------------------------------------------------------


def start(cmd: Command) -> subprocess.Popen:
  """Starts `cmd` in its own session, so that it (and only it) can be ended by its PID."""
  env = dict(os.environ)
  env.update(dict(cmd.env))
  return subprocess.Popen(list(cmd.argv), env=env, start_new_session=True)


def _signal(proc: subprocess.Popen, sig: int) -> None:
  try:
    if sig == signal.SIGKILL and os.getpgid(proc.pid) == proc.pid:
      # The group we created for this child: takes its own children (e.g. python under `timeout`).
      os.killpg(proc.pid, sig)
    else:
      proc.send_signal(sig)
  except ProcessLookupError:
    pass


def stop(procs: Sequence[subprocess.Popen], grace_s: float = TERM_GRACE_S) -> None:
  """SIGTERM to each process still running, then SIGKILL to those alive after `grace_s`."""
  alive = [p for p in procs if p.poll() is None]
  for p in alive:
    log(f"stopping pid {p.pid} (SIGTERM)")
    _signal(p, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for p in alive:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      log(f"pid {p.pid} ignored SIGTERM for {grace_s:.0f}s; SIGKILL")
      _signal(p, signal.SIGKILL)
      p.wait()


def _exit_status(code: int) -> int:
  """Popen's -N (killed by signal N) as the shell reports it: 128 + N."""
  return 128 - code if code < 0 else code


class _SigtermAsExit:
  """While active, SIGTERM to the launcher raises SystemExit(143) so the `finally` blocks that stop
  the children run (each child then gets its own SIGTERM and can checkpoint). `run` then exits
  with its child's own status (42 once the trainer has checkpointed), as docs/launch.md says."""

  def __enter__(self):
    self._installed = _in_main_thread()  # Python only lets the main thread set handlers.
    if self._installed:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # A second SIGTERM must not cut the cleanup.
    log("launcher got SIGTERM; stopping its processes, no restart")
    raise SystemExit(128 + signum)

  def __exit__(self, *exc):
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
    return False


def _in_main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


def run(cmd: Command) -> int:
  """Runs one command to completion and returns its exit status (SIGTERM/Ctrl-C stop it too)."""
  with _SigtermAsExit():
    proc = start(cmd)
    try:
      return _exit_status(proc.wait())
    except SystemExit:  # SIGTERM to the launcher: the trainer's status, not 143 (a probe).
      stop([proc])
      if proc.returncode is None:
        raise
      raise SystemExit(_exit_status(proc.returncode)) from None
    finally:
      stop([proc])


def run_to_end(cmd: Command) -> int:
  """Runs one command to completion while the launcher ignores SIGTERM and Ctrl-C.

  For cleanup that must not be cut short, e.g. stopping a remote trainer after the launcher was
  told to stop: a second signal then cannot leave the trainer running. The child runs in its own
  session, so Ctrl-C at the terminal does not reach it either.
  """
  handlers = {}
  if _in_main_thread():
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    return _exit_status(start(cmd).wait())
  finally:
    for sig, handler in handlers.items():
      signal.signal(sig, handler)


def supervise(commands: Sequence[Command], poll_s: float = 0.2,
              grace_s: float = TERM_GRACE_S) -> int:
  """Runs `commands` side by side; returns 0 when all exit 0, else the first failure's status.

  As soon as one process fails, the others are stopped (SIGTERM, then SIGKILL after `grace_s`):
  a multi-worker job cannot make progress without all of its workers. When several fail in the
  same poll, a code that is not a restart code wins, so a real crash is never retried.
  """
  with _SigtermAsExit():
    procs = []
    try:
      for cmd in commands:
        procs.append(start(cmd))
      while True:
        codes = [p.poll() for p in procs]
        failed = _failures(codes)
        if failed:
          index, code = _first_failure(failed)
          log(f"process {index} (pid {procs[index].pid}) exited with {describe_exit(code)}; "
              "stopping the others")
          stop(procs, grace_s)
          return code
        if all(c == 0 for c in codes):
          return 0
        time.sleep(poll_s)
    except SystemExit:  # SIGTERM to the launcher: the workers' status (42), not 143.
      stop(procs, grace_s)
      if not procs or any(p.returncode is None for p in procs):
        raise
      failed = _failures([p.returncode for p in procs])
      raise SystemExit(_first_failure(failed)[1] if failed else 0) from None
    finally:
      stop(procs, grace_s)


def _failures(codes):
  """(index, status) of each process that exited other than 0 (None: still running)."""
  return [(i, _exit_status(c)) for i, c in enumerate(codes) if c not in (None, 0)]


def _first_failure(failed):
  """(index, status) of the failure that decides: a status that is no restart code (a real
  crash is never retried), else the first."""
  return ([f for f in failed if f[1] not in RESTART_CODES] or failed)[0]


def run_with_restarts(attempt: Callable[[int], int], max_restarts: int, what: str,
                      restart_codes: Sequence[int] = RESTART_CODES,
                      delay_s: float = 0.0) -> int:
  """Calls `attempt(n)` for n = 0, 1, ... while it returns a restart code, at most
  `1 + max_restarts` times; returns the last status."""
  restarts = 0
  while True:
    code = attempt(restarts)
    if code not in restart_codes:
      return code
    if restarts >= max_restarts:
      log(f"{what} exited with {describe_exit(code)}; no restarts left (--max_restarts="
          f"{max_restarts})")
      return code
    restarts += 1
    log(f"{what} exited with {describe_exit(code)}; restart {restarts}/{max_restarts}, "
        "resuming from the last checkpoint")
    time.sleep(delay_s)


def run_main(main: Callable[[Sequence[str]], int]) -> None:
  """`absl.app.run(main)`, with `LaunchError` printed as a single `error:` line and exit 2."""

  def wrapped(argv):
    if len(argv) > 1:
      print(f"error: unexpected arguments {argv[1:]}; every option is a --flag", file=sys.stderr)
      return 2
    try:
      return main(argv)
    except LaunchError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    except KeyboardInterrupt:
      print("error: interrupted (Ctrl-C)", file=sys.stderr)
      return 130

  app.run(wrapped, flags_parser=_parse_flags)


def _parse_flags(argv):
  """absl's parsing, with a bad flag (`--gpus=abc`, an unknown one) as one `error:` line and
  exit 2, as docs/launch.md says; absl's own is two lines and exit 1 (found by a probe)."""
  try:
    with flag_errors.help_exits_zero(argv):
      return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(2)
