"""Every gcloud command of one TPU job, built from the flags; nothing here runs anything.

`TpuPlan` turns the launcher's flags into `common.Command`s, in the order `launch.tpu_vm` runs
them (and `--dry_run` prints them):

  provision  gcloud compute tpus tpu-vm describe | create       (or queued-resources create,
                                                                 then describe until ACTIVE)
  copy       ssh --worker=all 'mkdir -p DIR'; scp --recurse trainer configs launch --worker=all
  install    ssh --worker=all 'pip install -r launch/requirements-tpu.txt; pip install --no-deps'
  check      ssh --worker=0   'python3 -m launch.tpu_remote check --tpu=ADDRESS --env=...'
  start      ssh --worker=0   'python3 -m launch.tpu_remote start --run_id=R --env=... -- TRAINER'
  wait       ssh --worker=0   'python3 -m launch.tpu_remote wait --run_id=R'
  stop       ssh --worker=0   'python3 -m launch.tpu_remote stop --run_id=R'   (on SIGTERM/Ctrl-C)

Every worker gets the code and the pins; the trainer runs on worker 0 only. On a single-host
slice worker 0 is the only VM; on a pod slice it is TensorFlow's one client, which drives the
whole slice by its name (see launch/tpu_runtime.py). The run on the VM is handled by
launch/tpu_remote.py, whose commands are safe to repeat: gcloud re-runs a `--command` when ssh
fails (google-cloud-sdk surface/compute/tpus/tpu_vm/ssh.py, `_AttemptSSHWithRetries`: 10
attempts, 5 s apart).
"""
import pathlib
import re
import shlex
from typing import Sequence

from launch import common
from launch import tpu_runtime

DEFAULT_COPY = ("trainer", "configs", "launch")
CLIENT_WORKER = "0"
# `value()` prints the fields tab-separated; a boolean prints as True, an unset field as nothing.
VM_FIELDS = ("state", "acceleratorType", "runtimeVersion", "schedulingConfig.spot")
_NO_DEPS_RE = re.compile(r"^#\s*no-deps:\s*(\S+)\s*$")
_TF_PIN_RE = re.compile(r"^tensorflow-tpu==([0-9][0-9.]*)\s*(#.*)?$")


def read_requirements(path: str) -> tuple[str, list[str]]:
  """(the `tensorflow-tpu==X.Y.Z` version, the `# no-deps: SPEC` lines) of a requirements file."""
  file = pathlib.Path(path)
  if not file.is_absolute():
    file = common.REPO_ROOT / file
  if not file.is_file():
    raise common.LaunchError(f"--requirements={path}: no such file; allowed: a requirements "
                             "file inside the repo, e.g. launch/requirements-tpu.txt")
  tf_versions, no_deps = [], []
  for line in file.read_text().splitlines():
    line = line.strip()
    if match := _NO_DEPS_RE.match(line):
      no_deps.append(match.group(1))
    elif match := _TF_PIN_RE.match(line):
      tf_versions.append(match.group(1))
  if len(tf_versions) != 1:
    raise common.LaunchError(
        f"--requirements={path} must pin tensorflow-tpu exactly once (it picks the TPU runtime); "
        f"allowed: tensorflow-tpu==X.Y.Z with X.Y.Z one of "
        f"{', '.join(tpu_runtime.LISTED_TF_VERSIONS)}")
  return tf_versions[0], no_deps


class TpuPlan:
  """The commands of one TPU job; `run_id` names the job's runs on the VM (`RUN_ID-ATTEMPT`)."""

  def __init__(self, tpu_name: str, zone: str, config: str, workdir: str, run_id: str,
               project: str = "", accelerator_type: str = "v4-8", runtime_version: str = "",
               queued_resource: bool = False, queued_resource_id: str = "", spot: bool = False,
               best_effort: bool = False, overrides: Sequence[str] = (),
               remote_dir: str = "~/microstep", copy: Sequence[str] = DEFAULT_COPY,
               requirements: str = "launch/requirements-tpu.txt", python: str = "python3",
               stop_grace_s: float = 600):
    common.check_required(tpu_name=tpu_name, zone=zone, config=config, workdir=workdir,
                          accelerator_type=accelerator_type, remote_dir=remote_dir,
                          python=python, run_id=run_id)
    if not workdir.startswith("gs://"):
      raise common.LaunchError(f"--workdir={workdir} is invalid; allowed: a gs:// path (the TPU "
                               "VM's disk is lost when it is preempted or recreated)")
    if spot and best_effort:
      raise common.LaunchError("--spot and --best_effort exclude each other; pass at most one")
    if best_effort and not queued_resource:
      raise common.LaunchError("--best_effort needs --queued_resource (it is a queued-resource "
                               "tier)")
    if not copy:
      raise common.LaunchError("--copy is empty; allowed: repo paths, e.g. trainer,configs,launch")
    if stop_grace_s <= 0:
      raise common.LaunchError(f"--stop_grace_s={stop_grace_s} is invalid; allowed: seconds > 0")
    common.check_config_file(config)
    tf_version, self.no_deps = read_requirements(requirements)
    self.runtime = tpu_runtime.choose(accelerator_type, tf_version, runtime_version)
    self.name = tpu_name
    self.config = config
    self.workdir = workdir
    self.run_id = run_id
    self.queued_resource = queued_resource
    self.qr_id = queued_resource_id or f"{tpu_name}-qr"
    self.spot = spot
    self.best_effort = best_effort
    self.remote_dir = remote_dir.rstrip("/") or "/"
    self.copy = list(copy)
    self.requirements = requirements
    self.python = python
    self.stop_grace_s = stop_grace_s
    self.tpu_address, self.client_env = self.runtime.client(tpu_name)
    self.settings = common.merge_settings(
        {"strategy": "tpu", "tpu_address": self.tpu_address},
        common.parse_overrides(overrides),
        f"for --accelerator_type={accelerator_type}")
    self._where = [f"--zone={zone}"] + ([f"--project={project}"] if project else [])

  # --- Provisioning. ---

  def _qr(self, verb: str, *args: str, alpha: bool = False) -> common.Command:
    track = ["alpha"] if alpha else []
    return common.command("gcloud", *track, "compute", "tpus", "queued-resources", verb,
                          self.qr_id, *self._where, *args)

  def _vm(self, verb: str, *args: str) -> common.Command:
    return common.command("gcloud", "compute", "tpus", "tpu-vm", verb, self.name, *self._where,
                          *args)

  def create(self) -> common.Command:
    """Exactly the spec of the flags: recreating after a preemption runs this same command."""
    accelerator = f"--accelerator-type={self.runtime.accelerator_type}"
    if self.queued_resource:
      tier = ["--spot"] if self.spot else ["--best-effort"] if self.best_effort else []
      return self._qr("create", f"--node-id={self.name}", accelerator,
                      f"--runtime-version={self.runtime.image}", *tier, alpha=self.best_effort)
    return self._vm("create", accelerator, f"--version={self.runtime.image}",
                    *(["--spot"] if self.spot else []))

  def delete(self) -> common.Command:
    if self.queued_resource:
      return self._qr("delete", "--force", "--quiet")  # --force: deletes the TPU VM too.
    return self._vm("delete", "--quiet")

  def describe_qr(self) -> common.Command:
    return self._qr("describe", "--format=value(state.state)")

  def describe_vm(self) -> common.Command:
    return self._vm("describe", f"--format=value({','.join(VM_FIELDS)})")

  def expected_vm(self) -> tuple[str, str, str]:
    """(acceleratorType, runtimeVersion, spot) as `describe_vm` prints them for this plan."""
    return self.runtime.accelerator_type, self.runtime.image, "True" if self.spot else ""

  # --- On the TPU workers. ---

  def ssh(self, worker: str, remote_command: str, *extra: str) -> common.Command:
    return self._vm("ssh", f"--worker={worker}", *extra, f"--command={remote_command}")

  def _in_repo(self, *words: str) -> str:
    return f"cd {common.remote_path(self.remote_dir)} && {shlex.join(words)}"

  def _agent(self, *args: str) -> str:
    return self._in_repo(self.python, "-m", "launch.tpu_remote", *args)

  def _env_flags(self) -> list[str]:
    return [f"--env={name}={value}" for name, value in self.client_env]

  def mkdir(self) -> common.Command:
    return self.ssh("all", f"mkdir -p {common.remote_path(self.remote_dir)}")

  def scp(self) -> common.Command:
    return common.command("gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse", *self.copy,
                          f"{self.name}:{self.remote_dir}/", *self._where, "--worker=all")

  def install(self) -> common.Command:
    pip = f"{shlex.quote(self.python)} -m pip install"
    steps = [f"cd {common.remote_path(self.remote_dir)}",
             f"{pip} -r {shlex.quote(self.requirements)}"]
    if self.no_deps:
      steps.append(f"{pip} --no-deps {' '.join(shlex.quote(s) for s in self.no_deps)}")
    return self.ssh("all", " && ".join(steps))

  def check(self) -> common.Command:
    return self.ssh(CLIENT_WORKER,
                    self._agent("check", f"--tpu={self.tpu_address}", *self._env_flags()))

  def setup(self) -> list[tuple[str, common.Command]]:
    """(what, command) for copy, install and the install check, in order."""
    return [("creating the remote directory", self.mkdir()), ("copying the repo", self.scp()),
            ("installing the TPU requirements", self.install()),
            ("checking that TensorFlow sees the TPU", self.check())]

  def attempt_id(self, attempt: int) -> str:
    return f"{self.run_id}-{attempt}"

  def start(self, attempt: int) -> common.Command:
    trainer = common.trainer_argv(self.python, self.config, self.workdir, self.settings)
    return self.ssh(CLIENT_WORKER, self._agent(
        "start", f"--run_id={self.attempt_id(attempt)}", f"--grace_s={self.stop_grace_s:g}",
        *self._env_flags(), "--", *trainer))

  def wait(self, attempt: int) -> common.Command:
    # Keep-alives make ssh notice a vanished (preempted) VM within minutes instead of hanging.
    return self.ssh(CLIENT_WORKER, self._agent("wait", f"--run_id={self.attempt_id(attempt)}"),
                    "--ssh-flag=-oServerAliveInterval=60")

  def stop(self, attempt: int) -> common.Command:
    return self.ssh(CLIENT_WORKER, self._agent(
        "stop", f"--run_id={self.attempt_id(attempt)}", f"--grace_s={self.stop_grace_s:g}"))
