"""Runs the trainer as a multi-worker job (`MultiWorkerMirroredStrategy`), one process per worker.

Every worker runs the same command with `--config.strategy=multi_worker_mirrored`; only the
`TF_CONFIG` environment variable differs. It lists the whole cluster and says which worker this is:

  TF_CONFIG='{"cluster":{"worker":["h1:2222","h2:2222"]},"task":{"type":"worker","index":0}}'

Worker 0 is the chief (it writes the checkpoints and summaries). Two modes:

  --hosts=h1:2222,h2:2222   one worker per host:port, started with
                            `ssh HOST 'cd REMOTE_DIR && TF_CONFIG=... python3 -m trainer.main ...'`.
                            The repo must be checked out at --remote_dir on every host and
                            --workdir must be shared by all of them (NFS, gs://).
  --local=N                 N workers on this machine (127.0.0.1, CPU only, free ports found by
                            binding port 0), each under `timeout -k 30 --timeout_s`. A rehearsal of
                            a real cluster, and what the tests run.

The launcher waits for all workers. When one fails it stops the others (SIGTERM by PID, SIGKILL
after a grace period) and exits with the failed worker's status. When that status is
PEER_LOST_EXIT_CODE or PREEMPTED_EXIT_CODE, all workers are started again together (new ports in
local mode), at most --max_restarts times; they resume from the last checkpoint.
"""
import json
import shlex
import sys
from typing import Sequence

from absl import flags

from launch import common

LOCAL_HOST = "127.0.0.1"
DEFAULT_LOCAL_TIMEOUT_S = 3600

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the flags; called only when run as a program, so that the launchers (and the
  trainer, which has its own --config) can be imported into one process, e.g. by tests."""
  flags.DEFINE_string("config", None, "Recipe file and args, e.g. configs/fashion_mnist.py:smoke.")
  flags.DEFINE_string("workdir", None, "Checkpoints and summaries, shared by all workers.")
  flags.DEFINE_list("hosts", [], "Remote mode: comma-separated host:port, one per worker.")
  flags.DEFINE_integer("local", 0, "Local mode: number of workers on 127.0.0.1.")
  flags.DEFINE_integer(
      "timeout_s", None,
      "Kill each worker after this many seconds (`timeout -k 30`). Default: "
      f"{DEFAULT_LOCAL_TIMEOUT_S} in local mode, no limit in remote mode.")
  flags.DEFINE_multi_string(
      "override", [], "Config override FIELD=VALUE (repeatable), passed as --config.FIELD=VALUE.")
  flags.DEFINE_integer(
      "max_restarts", 3, "Restarts of all workers after a peer-lost (43) or preempted (42) exit.")
  flags.DEFINE_string(
      "python", None, "Python on the workers. Default: this interpreter locally, python3 remotely.")
  flags.DEFINE_string("remote_dir", "~/microstep", "Remote mode: repo checkout on each host.")
  flags.DEFINE_string("ssh", "ssh", "Remote mode: ssh command, e.g. 'ssh -i ~/.ssh/key'.")
  flags.DEFINE_bool("dry_run", False, "Print one shell line per worker and run nothing.")


def tf_config(workers: Sequence[str], index: int) -> str:
  """The TF_CONFIG JSON of worker `index` in a cluster of `workers` (host:port strings)."""
  return json.dumps({"cluster": {"worker": list(workers)},
                     "task": {"type": "worker", "index": index}}, separators=(",", ":"))


def parse_hosts(hosts: Sequence[str]) -> list[str]:
  """Validates `host:port` entries; returns them unchanged."""
  for entry in hosts:
    host, sep, port = entry.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise common.LaunchError(
          f"--hosts entry {entry!r} is invalid; allowed: host:port with a port in 1..65535, "
          "e.g. --hosts=10.0.0.2:2222,10.0.0.3:2222")
  if len(set(hosts)) != len(hosts):
    raise common.LaunchError(f"--hosts={','.join(hosts)} lists a host:port twice; each worker "
                             "needs its own")
  return list(hosts)


def _settings(overrides: Sequence[str]) -> list[tuple[str, str]]:
  return common.merge_settings({"strategy": "multi_worker_mirrored"},
                               common.parse_overrides(overrides), "for a multi-worker job")


def _timeout_prefix(timeout_s: int | None) -> list[str]:
  # SIGTERM (from the launcher, or at `timeout_s`) gives the worker common.TERM_GRACE_S to write
  # its checkpoint at the end of its loop, as the launcher's own stop does; with 5 s, a worker
  # stopped while tracing its first step was SIGKILLed (137; a probe, 2026-12-07).
  return ["timeout", "-k", f"{common.TERM_GRACE_S:g}", str(timeout_s)] if timeout_s else []


def local_commands(n: int, config: str, workdir: str, overrides: Sequence[str] = (),
                   timeout_s: int | None = None, python: str | None = None,
                   ports: Sequence[int] | None = None) -> list[common.Command]:
  """One command per local worker; `ports` default to fresh free ones on 127.0.0.1."""
  common.check_required(config=config, workdir=workdir)
  if n < 1:
    raise common.LaunchError(f"--local={n} is invalid; allowed: a worker count >= 1")
  timeout_s = DEFAULT_LOCAL_TIMEOUT_S if timeout_s is None else timeout_s
  if timeout_s <= 0:
    raise common.LaunchError(f"--timeout_s={timeout_s} is invalid in local mode; allowed: "
                             "seconds >= 1")
  common.check_config_file(config)
  ports = list(ports) if ports is not None else common.free_ports(n, LOCAL_HOST)
  workers = [f"{LOCAL_HOST}:{p}" for p in ports]
  argv = common.trainer_argv(python or sys.executable, config, workdir, _settings(overrides))
  return [common.command(*_timeout_prefix(timeout_s), *argv,
                         env={"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": tf_config(workers, i)})
          for i in range(n)]


def remote_commands(hosts: Sequence[str], config: str, workdir: str,
                    overrides: Sequence[str] = (), timeout_s: int | None = None,
                    python: str | None = None, remote_dir: str = "~/microstep",
                    ssh: str = "ssh") -> list[common.Command]:
  """One `ssh HOST 'cd DIR && TF_CONFIG=... python3 -m trainer.main ...'` per host."""
  common.check_required(config=config, workdir=workdir, remote_dir=remote_dir, ssh=ssh)
  workers = parse_hosts(hosts)
  if timeout_s is not None and timeout_s < 0:
    raise common.LaunchError(f"--timeout_s={timeout_s} is invalid; allowed: seconds >= 0 "
                             "(0: no limit)")
  argv = common.trainer_argv(python or "python3", config, workdir, _settings(overrides))
  commands = []
  for i, worker in enumerate(workers):
    host = worker.rpartition(":")[0]
    trainer = common.command(*_timeout_prefix(timeout_s), *argv,
                             env={"TF_CONFIG": tf_config(workers, i)})
    remote = f"cd {common.remote_path(remote_dir)} && {trainer.shell()}"
    commands.append(common.command(*shlex.split(ssh), host, remote))
  return commands


def build_commands(hosts: Sequence[str], local: int, **kwargs) -> list[common.Command]:
  """Remote or local commands, whichever mode the flags ask for (exactly one)."""
  if bool(hosts) == bool(local):
    raise common.LaunchError("pass exactly one of --hosts=h1:port,h2:port (remote) or "
                             "--local=N (workers on 127.0.0.1)")
  if local:
    kwargs.pop("remote_dir", None)
    kwargs.pop("ssh", None)
    return local_commands(local, **kwargs)
  return remote_commands(hosts, **kwargs)


def main(argv: Sequence[str]) -> int:
  del argv
  common.check_non_negative("max_restarts", FLAGS.max_restarts)
  kwargs = dict(config=FLAGS.config, workdir=FLAGS.workdir, overrides=FLAGS.override,
                timeout_s=FLAGS.timeout_s, python=FLAGS.python, remote_dir=FLAGS.remote_dir,
                ssh=FLAGS.ssh)
  first = build_commands(FLAGS.hosts, FLAGS.local, **kwargs)
  if FLAGS.dry_run:
    common.print_commands(first)
    return 0

  def attempt(n: int) -> int:
    # Local mode picks fresh ports on each restart: the old ones may still be held.
    commands = first if n == 0 else build_commands(FLAGS.hosts, FLAGS.local, **kwargs)
    for i, cmd in enumerate(commands):
      common.log(f"worker {i}: {cmd.shell()}")
    return common.supervise(commands)

  return common.run_with_restarts(attempt, FLAGS.max_restarts, "multi-worker job", delay_s=2.0)


if __name__ == "__main__":
  define_flags()
  common.run_main(main)
