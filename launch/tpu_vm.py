"""Runs the trainer on a Cloud TPU VM with gcloud: provision, copy, install, run, and recover.

  python -m launch.tpu_vm --tpu_name=fmnist --zone=us-central2-b --project=my-proj \
      --accelerator_type=v4-8 --queued_resource --spot --watch \
      --config=configs/fashion_mnist.py --workdir=gs://my-bucket/fmnist

The steps, each one gcloud command (`--dry_run` prints them in this order):

  1. provision  `queued-resources create QR --node-id=NAME ...` then `queued-resources describe`
                until the request is ACTIVE (with --queued_resource); otherwise the TPU VM NAME
                must already exist and be READY.
  2. copy       `tpu-vm ssh --command='mkdir -p ~/microstep'` and
                `tpu-vm scp --recurse trainer configs launch NAME:~/microstep/ --worker=all`.
  3. install    `pip install -r launch/requirements-tpu.txt` (tensorflow-tpu from the libtpu
                index), then `pip install --no-deps` for the packages marked `# no-deps:` in that
                file (tf-models-official, tf-keras: their normal install pulls in the `tensorflow`
                wheel on top of tensorflow-tpu).
  4. run        `tpu-vm ssh NAME --worker=all --command='cd ~/microstep && python3 -m
                trainer.main ... --config.strategy=tpu --config.tpu_address=local'`.

Each step is safe to repeat: a real run first looks the TPU up and skips `create` when it is
there (a dry run assumes it is not), `mkdir -p`, scp and pip overwrite. With `--watch`, when the
run ends in a preemption (exit PREEMPTED_EXIT_CODE, or the VM is PREEMPTED / the queued resource
SUSPENDED) the TPU is deleted and created again and steps 2-4 rerun; the trainer resumes from the
checkpoint in the gs:// workdir. At most `--max_restarts` times.
"""
import pathlib
import re
import shlex
import subprocess
import sys
import time
from typing import Callable, Sequence

from absl import flags

from launch import common
from trainer import exit_codes

DEFAULT_COPY = ("trainer", "configs", "launch")
PREEMPTED_VM_STATES = ("PREEMPTED", "TERMINATED")
PREEMPTED_QR_STATES = ("SUSPENDING", "SUSPENDED", "FAILED")
_NO_DEPS_RE = re.compile(r"^#\s*no-deps:\s*(\S+)\s*$")

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the flags; called only when run as a program, so that the launchers (and the
  trainer, which has its own --config) can be imported into one process, e.g. by tests."""
  flags.DEFINE_string("tpu_name", None, "TPU VM (node) name.")
  flags.DEFINE_string("zone", None, "Zone, e.g. us-central2-b.")
  flags.DEFINE_string("project", "", "GCP project; empty: gcloud's default project.")
  flags.DEFINE_string("accelerator_type", "v4-8", "e.g. v4-8, v5litepod-8.")
  flags.DEFINE_string(
      "runtime_version", "tpu-ubuntu2204-base",
      "TPU software image (a bare base image: tensorflow-tpu is pip-installed).")
  flags.DEFINE_bool(
      "queued_resource", False, "Create the TPU as a queued resource; else use an existing TPU VM.")
  flags.DEFINE_string(
      "queued_resource_id", "", "Queued resource name; empty: TPU_NAME-qr.")
  flags.DEFINE_bool("spot", False, "Request Spot capacity (cheaper, can be preempted).")
  flags.DEFINE_bool(
      "best_effort", False, "Queued resource at the best-effort tier (gcloud alpha only).")
  flags.DEFINE_string("config", None, "Recipe file and args, e.g. configs/fashion_mnist.py.")
  flags.DEFINE_string("workdir", None, "gs:// directory for checkpoints and summaries.")
  flags.DEFINE_multi_string(
      "override", [], "Config override FIELD=VALUE (repeatable), passed as --config.FIELD=VALUE.")
  flags.DEFINE_bool("watch", False, "After a preemption, recreate the TPU and resume.")
  flags.DEFINE_integer("max_restarts", 3, "Recreations of the TPU under --watch.")
  flags.DEFINE_integer("poll_s", 60, "Seconds between state checks of a queued resource.")
  flags.DEFINE_string("remote_dir", "~/microstep", "Repo copy on each TPU worker.")
  flags.DEFINE_list("copy", list(DEFAULT_COPY), "Repo paths copied to --remote_dir.")
  flags.DEFINE_string(
      "requirements", "launch/requirements-tpu.txt", "Requirements file (repo-relative).")
  flags.DEFINE_string("python", "python3", "Python on the TPU VM.")
  flags.DEFINE_bool("dry_run", False, "Print every gcloud command in order; run nothing.")


def no_deps_requirements(path: str | pathlib.Path) -> list[str]:
  """The `# no-deps: SPEC` lines of a requirements file: installed with `pip --no-deps`."""
  path = pathlib.Path(path)
  if not path.is_absolute():
    path = common.REPO_ROOT / path
  if not path.is_file():
    raise common.LaunchError(f"--requirements={path}: no such file; allowed: a requirements "
                             "file inside the repo, e.g. launch/requirements-tpu.txt")
  specs = []
  for line in path.read_text().splitlines():
    match = _NO_DEPS_RE.match(line.strip())
    if match:
      specs.append(match.group(1))
  return specs


class TpuPlan:
  """Builds every gcloud command of one TPU job; runs nothing itself."""

  def __init__(self, tpu_name: str, zone: str, config: str, workdir: str, project: str = "",
               accelerator_type: str = "v4-8", runtime_version: str = "tpu-ubuntu2204-base",
               queued_resource: bool = False, queued_resource_id: str = "", spot: bool = False,
               best_effort: bool = False, overrides: Sequence[str] = (),
               remote_dir: str = "~/microstep", copy: Sequence[str] = DEFAULT_COPY,
               requirements: str = "launch/requirements-tpu.txt", python: str = "python3"):
    common.check_required(tpu_name=tpu_name, zone=zone, config=config, workdir=workdir,
                          accelerator_type=accelerator_type, runtime_version=runtime_version,
                          remote_dir=remote_dir, python=python)
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
    common.check_config_file(config)
    self.name = tpu_name
    self.config = config
    self.workdir = workdir
    self.accelerator_type = accelerator_type
    self.runtime_version = runtime_version
    self.queued_resource = queued_resource
    self.qr_id = queued_resource_id or f"{tpu_name}-qr"
    self.spot = spot
    self.best_effort = best_effort
    self.remote_dir = remote_dir.rstrip("/") or "/"
    self.copy = list(copy)
    self.requirements = requirements
    self.no_deps = no_deps_requirements(requirements)
    self.python = python
    self.settings = common.merge_settings(
        {"strategy": "tpu", "tpu_address": "local"}, common.parse_overrides(overrides),
        "on a TPU VM")
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
    if self.queued_resource:
      tier = ["--spot"] if self.spot else ["--best-effort"] if self.best_effort else []
      return self._qr("create", f"--node-id={self.name}",
                      f"--accelerator-type={self.accelerator_type}",
                      f"--runtime-version={self.runtime_version}", *tier, alpha=self.best_effort)
    return self._vm("create", f"--accelerator-type={self.accelerator_type}",
                    f"--version={self.runtime_version}", *(["--spot"] if self.spot else []))

  def delete(self) -> common.Command:
    if self.queued_resource:
      return self._qr("delete", "--force", "--quiet")  # --force: deletes the TPU VM too.
    return self._vm("delete", "--quiet")

  def describe_qr(self) -> common.Command:
    return self._qr("describe", "--format=value(state.state)")

  def describe_vm(self) -> common.Command:
    return self._vm("describe", "--format=value(state)")

  # --- On the TPU workers. ---

  def ssh(self, remote_command: str, *extra: str) -> common.Command:
    return self._vm("ssh", "--worker=all", *extra, f"--command={remote_command}")

  def mkdir(self) -> common.Command:
    return self.ssh(f"mkdir -p {common.remote_path(self.remote_dir)}")

  def scp(self) -> common.Command:
    return common.command("gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse", *self.copy,
                          f"{self.name}:{self.remote_dir}/", *self._where, "--worker=all")

  def install(self) -> common.Command:
    pip = f"{shlex.quote(self.python)} -m pip install"
    steps = [f"cd {common.remote_path(self.remote_dir)}",
             f"{pip} -r {shlex.quote(self.requirements)}"]
    if self.no_deps:
      steps.append(f"{pip} --no-deps {' '.join(shlex.quote(s) for s in self.no_deps)}")
    return self.ssh(" && ".join(steps))

  def train(self) -> common.Command:
    argv = common.trainer_argv(self.python, self.config, self.workdir, self.settings)
    # Keep-alives make ssh notice a vanished (preempted) VM within minutes instead of hanging.
    return self.ssh(f"cd {common.remote_path(self.remote_dir)} && {shlex.join(argv)}",
                    "--ssh-flag=-oServerAliveInterval=60")

  def setup(self) -> list[tuple[str, common.Command]]:
    """(what, command) for steps 2 and 3: copy the repo to every worker, install the pins."""
    return [("creating the remote directory", self.mkdir()), ("copying the repo", self.scp()),
            ("installing the TPU requirements", self.install())]


class Runner:
  """Runs commands, or with `dry_run` only prints them (and answers state queries as healthy)."""

  def __init__(self, dry_run: bool, out=None, sleep: Callable[[float], None] = time.sleep):
    self.dry_run = dry_run
    self.out = out or sys.stdout
    self.sleep = sleep

  def run(self, cmd: common.Command) -> int:
    if self.dry_run:
      common.print_commands([cmd], self.out)
      return 0
    common.log(f"running: {cmd.shell()}")
    return common.run(cmd)

  def query(self, cmd: common.Command, dry_answer: str = "") -> tuple[int, str]:
    """Runs a read-only command and returns (status, stripped stdout)."""
    if self.dry_run:
      common.print_commands([cmd], self.out)
      return 0, dry_answer
    done = subprocess.run(list(cmd.argv), capture_output=True, text=True, check=False)
    return done.returncode, done.stdout.strip()


def _check(code: int, what: str) -> None:
  if code != 0:
    raise common.LaunchError(f"{what} failed with exit status {code} (see gcloud's output above)")


def provision(plan: TpuPlan, runner: Runner, poll_s: float, fresh: bool) -> None:
  """Makes sure the TPU exists and is usable: creates it unless it is there (or `fresh`)."""
  if plan.queued_resource:
    exists = False
    if not runner.dry_run and not fresh:
      code, state = runner.query(plan.describe_qr())
      exists = code == 0 and state not in PREEMPTED_QR_STATES
      if code == 0 and not exists:
        _check(runner.run(plan.delete()), "deleting the queued resource")
    if not exists:
      _check(runner.run(plan.create()), "creating the queued resource")
    while True:
      code, state = runner.query(plan.describe_qr(), dry_answer="ACTIVE")
      if code == 0 and state == "ACTIVE":
        return
      if state == "FAILED":
        raise common.LaunchError(f"queued resource {plan.qr_id} FAILED; see `gcloud compute "
                                 "tpus queued-resources describe`")
      common.log(f"queued resource {plan.qr_id}: {state or 'not visible yet'}; waiting")
      runner.sleep(poll_s)
  if fresh:
    _check(runner.run(plan.create()), "creating the TPU VM")
  elif not runner.dry_run:
    code, state = runner.query(plan.describe_vm())
    if code != 0 or state != "READY":
      raise common.LaunchError(
          f"--tpu_name={plan.name}: no READY TPU VM in that zone (state {state or 'none'}); "
          "create it first or pass --queued_resource")


def preempted(plan: TpuPlan, runner: Runner, code: int) -> bool:
  """Whether a run that ended with `code` was cut by a preemption (not a bug in the run)."""
  if code == exit_codes.PREEMPTED_EXIT_CODE:
    return True
  _, state = runner.query(plan.describe_vm())
  if state in PREEMPTED_VM_STATES:
    return True
  if plan.queued_resource:
    _, state = runner.query(plan.describe_qr())
    return state in PREEMPTED_QR_STATES
  return False


def launch(plan: TpuPlan, runner: Runner, watch: bool, max_restarts: int,
           poll_s: float = 60) -> int:
  """Provisions, copies, installs and trains; with `watch`, recreates the TPU after preemptions."""
  provision(plan, runner, poll_s, fresh=False)
  restarts = 0
  while True:
    for what, cmd in plan.setup():
      _check(runner.run(cmd), what)
    code = runner.run(plan.train())
    if code == 0 or not watch or runner.dry_run:
      return code
    if not preempted(plan, runner, code):
      common.log(f"the run failed with exit status {code}, not a preemption; not restarting")
      return code
    if restarts >= max_restarts:
      common.log(f"preempted again; no restarts left (--max_restarts={max_restarts})")
      return code
    restarts += 1
    common.log(f"preempted (exit {common.describe_exit(code)}); recreating the TPU, restart "
               f"{restarts}/{max_restarts}")
    _check(runner.run(plan.delete()), "deleting the preempted TPU")
    provision(plan, runner, poll_s, fresh=True)


def main(argv: Sequence[str]) -> int:
  del argv
  common.check_non_negative("max_restarts", FLAGS.max_restarts)
  common.check_non_negative("poll_s", FLAGS.poll_s)
  plan = TpuPlan(
      tpu_name=FLAGS.tpu_name, zone=FLAGS.zone, config=FLAGS.config, workdir=FLAGS.workdir,
      project=FLAGS.project, accelerator_type=FLAGS.accelerator_type,
      runtime_version=FLAGS.runtime_version, queued_resource=FLAGS.queued_resource,
      queued_resource_id=FLAGS.queued_resource_id, spot=FLAGS.spot,
      best_effort=FLAGS.best_effort, overrides=FLAGS.override, remote_dir=FLAGS.remote_dir,
      copy=FLAGS.copy, requirements=FLAGS.requirements, python=FLAGS.python)
  return launch(plan, Runner(FLAGS.dry_run), FLAGS.watch, FLAGS.max_restarts, FLAGS.poll_s)


if __name__ == "__main__":
  define_flags()
  common.run_main(main)
