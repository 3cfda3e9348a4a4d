"""Runs the trainer on a Cloud TPU VM (one host or a pod slice) with gcloud, and recovers it.

  python -m launch.tpu_vm --tpu_name=fmnist --zone=us-central2-b --project=my-proj \\
      --accelerator_type=v4-8 --queued_resource --spot --watch \\
      --config=configs/fashion_mnist.py --workdir=gs://my-bucket/fmnist

What happens, one gcloud command per step (`--dry_run` prints them; launch/tpu_commands.py builds
them, launch/tpu_runtime.py picks the software):

  provision   Looks the TPU up. Absent: creates it with the TensorFlow runtime image of the table
              (`tpu-vm-tf-X.Y.Z[-pod]-pjrt` ...), as a queued resource with --queued_resource.
              Present: it must match the flags (accelerator, image, spot) and be READY.
  setup       Copies the repo and installs the pins on every worker, then the install check on
              worker 0: TensorFlow must list TPU devices, else the launcher stops with one line.
  start       Starts the trainer detached on worker 0 under a pidfile (launch/tpu_remote.py),
              after stopping any leftover trainer there by its PID.
  wait        Follows the trainer's log until it exits; the trainer's status is the launcher's.

Signals. SIGTERM or Ctrl-C to this launcher sends `tpu_remote stop` to the VM: SIGTERM to the
trainer's PID, then up to --stop_grace_s for it to write a checkpoint and exit 42 (SIGKILL after).
The launcher exits with that status and does not restart.

Recovery with --watch, at most --max_restarts times, resuming from the checkpoint in the gs://
workdir:
  exit 42 (or 43) and the VM READY   start again on the same VM.
  the VM PREEMPTED / TERMINATED / gone, or the queued resource SUSPENDED / FAILED
                                     delete the TPU and create it again from the same flags,
                                     then setup and start. Only a TPU this launcher created is
                                     deleted, unless --recreate_existing says otherwise.
  any other exit                     returned as is: a crash is never retried.
An ssh that drops (exit 255) while the VM is READY only re-attaches `wait`, up to 3 times.
"""
import subprocess
import sys
import time
from typing import Callable, Sequence

from absl import flags

from launch import common
from launch import tpu_commands
from launch import tpu_runtime

PREEMPTED_VM_STATES = ("PREEMPTED", "TERMINATED")
PREEMPTED_QR_STATES = ("SUSPENDING", "SUSPENDED", "FAILED")
SSH_FAILED = 255   # ssh's own status when the connection fails or drops.
MAX_REATTACH = 3

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the flags; called only when run as a program, so that the launchers (and the
  trainer, which has its own --config) can be imported into one process, e.g. by tests."""
  flags.DEFINE_string("tpu_name", None, "TPU VM (node) name; also the slice's address on a pod.")
  flags.DEFINE_string("zone", None, "Zone, e.g. us-central2-b.")
  flags.DEFINE_string("project", "", "GCP project; empty: gcloud's default project.")
  flags.DEFINE_string("accelerator_type", "v4-8", "e.g. v4-8, v5litepod-8, v6e-8, v4-32 (pod).")
  flags.DEFINE_string(
      "runtime_version", "",
      "TPU software image; empty: the table's default for the accelerator and the TensorFlow "
      "pin (see launch/tpu_runtime.py). Only images the table allows are accepted.")
  flags.DEFINE_bool(
      "queued_resource", False, "Create the TPU as a queued resource (else with tpu-vm create).")
  flags.DEFINE_string("queued_resource_id", "", "Queued resource name; empty: TPU_NAME-qr.")
  flags.DEFINE_bool("spot", False, "Request Spot capacity (cheaper, can be preempted).")
  flags.DEFINE_bool(
      "best_effort", False, "Queued resource at the best-effort tier (gcloud alpha only).")
  flags.DEFINE_string("config", None, "Recipe file and args, e.g. configs/fashion_mnist.py.")
  flags.DEFINE_string("workdir", None, "gs:// directory for checkpoints and summaries.")
  flags.DEFINE_multi_string(
      "override", [], "Config override FIELD=VALUE (repeatable), passed as --config.FIELD=VALUE.")
  flags.DEFINE_bool("watch", False, "After a preemption, restart or recreate the TPU and resume.")
  flags.DEFINE_bool(
      "recreate_existing", False,
      "Let the launcher delete and recreate (from these flags) a preempted TPU it did not create.")
  flags.DEFINE_integer("max_restarts", 3, "Restarts and recreations under --watch.")
  flags.DEFINE_integer("poll_s", 60, "Seconds between state checks of a queued resource.")
  flags.DEFINE_integer(
      "provision_timeout_s", 86400, "Give up when a queued resource is not ACTIVE by then.")
  flags.DEFINE_float(
      "stop_grace_s", 600, "After SIGTERM, seconds the trainer gets to checkpoint before SIGKILL.")
  flags.DEFINE_string("remote_dir", "~/microstep", "Repo copy on each TPU worker.")
  flags.DEFINE_list("copy", list(tpu_commands.DEFAULT_COPY), "Repo paths copied to --remote_dir.")
  flags.DEFINE_string(
      "requirements", "launch/requirements-tpu.txt",
      "Requirements file (repo-relative); its tensorflow-tpu==X.Y.Z pin picks the TPU image.")
  flags.DEFINE_string("python", "python3", "Python on the TPU VM.")
  flags.DEFINE_string(
      "run_id", "", "Name of this launch's runs on the VM; empty: the launcher's start time.")
  flags.DEFINE_bool("dry_run", False, "Print every gcloud command in order; run nothing.")


class Runner:
  """Runs commands, or with `dry_run` only prints them (and answers state queries as healthy)."""

  def __init__(self, dry_run: bool, out=None, sleep: Callable[[float], None] = time.sleep):
    self.dry_run = dry_run
    self.out = out or sys.stdout
    self.sleep = sleep

  def run(self, cmd: common.Command) -> int:
    """Runs `cmd`; SIGTERM or Ctrl-C stop it and propagate (SystemExit / KeyboardInterrupt)."""
    return self._execute(cmd, common.run, "running")

  def run_to_end(self, cmd: common.Command) -> int:
    """Runs `cmd` to its end, deaf to SIGTERM and Ctrl-C (cleanup)."""
    return self._execute(cmd, common.run_to_end, "running to its end")

  def _execute(self, cmd: common.Command, run: Callable[[common.Command], int], what: str) -> int:
    if self.dry_run:
      common.print_commands([cmd], self.out)
      return 0
    common.log(f"{what}: {cmd.shell()}")
    return run(cmd)

  def query(self, cmd: common.Command, dry_answer: str | None = None) -> tuple[int, str]:
    """Runs a read-only command: (status, stripped stdout). A dry run prints it and answers
    `dry_answer`, or "not found" (status 1) when that is None."""
    if self.dry_run:
      common.print_commands([cmd], self.out)
      return (1, "") if dry_answer is None else (0, dry_answer)
    done = subprocess.run(list(cmd.argv), capture_output=True, text=True, check=False)
    return done.returncode, done.stdout.strip()


def _check(code: int, what: str) -> None:
  if code != 0:
    raise common.LaunchError(f"{what} failed with exit status {code} (see the output above)")


# --- Provisioning. -------------------------------------------------------------------------------


def _describe_vm(plan: tpu_commands.TpuPlan, runner: Runner):
  """The VM's (state, acceleratorType, runtimeVersion, spot), or None when it does not exist."""
  code, out = runner.query(plan.describe_vm())
  if code != 0:
    return None
  fields = (out.split("\t") + [""] * len(tpu_commands.VM_FIELDS))[:len(tpu_commands.VM_FIELDS)]
  return tuple(f.strip() for f in fields)


def _refuse_other_spec(plan: tpu_commands.TpuPlan, found) -> None:
  accelerator, image, spot = plan.expected_vm()
  if tuple(found[1:]) != (accelerator, image, spot):
    raise common.LaunchError(
        f"--tpu_name={plan.name} exists as {found[1]} with {found[2]}"
        f"{' (spot)' if found[3] else ''}, but the flags ask for --accelerator_type={accelerator} "
        f"with {image}{' (--spot)' if spot else ''}; allowed: flags that match it, or another "
        "--tpu_name")


def _wait_until_active(plan, runner: Runner, poll_s: float, timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while True:
    code, state = runner.query(plan.describe_qr(), dry_answer="ACTIVE")
    if code == 0 and state == "ACTIVE":
      return
    if state in ("FAILED", "SUSPENDED"):
      raise common.LaunchError(f"queued resource {plan.qr_id} is {state}; see `gcloud compute "
                               "tpus queued-resources describe`")
    if time.monotonic() > deadline:
      raise common.LaunchError(f"queued resource {plan.qr_id} not ACTIVE after "
                               f"--provision_timeout_s={timeout_s:g}; it keeps waiting in GCP")
    common.log(f"queued resource {plan.qr_id}: {state or 'not visible yet'}; waiting")
    runner.sleep(poll_s)


def provision(plan: tpu_commands.TpuPlan, runner: Runner, poll_s: float = 60,
              timeout_s: float = 86400, recreate_existing: bool = False,
              fresh: bool = False) -> bool:
  """Makes the TPU exist, READY, with the flags' spec; returns whether this call created it.

  `fresh`: the TPU was just deleted, so create it without looking it up first.
  """
  if plan.queued_resource:
    code, state = (1, "") if fresh else runner.query(plan.describe_qr())
    if code == 0 and state in PREEMPTED_QR_STATES:
      _delete_if_allowed(plan, runner, created=False, recreate_existing=recreate_existing,
                         why=f"queued resource {plan.qr_id} is {state}")
      code = 1
    created = code != 0
    if created:
      _check(runner.run(plan.create()), "creating the queued resource")
    _wait_until_active(plan, runner, poll_s, timeout_s)
    if not created:
      found = _describe_vm(plan, runner)
      if found is None:
        raise common.LaunchError(f"queued resource {plan.qr_id} is ACTIVE but its node "
                                 f"--tpu_name={plan.name} is missing; allowed: the QR's node-id")
      _refuse_other_spec(plan, found)
    return created
  found = None if fresh else _describe_vm(plan, runner)
  if found is not None and found[0] in PREEMPTED_VM_STATES:
    _delete_if_allowed(plan, runner, created=False, recreate_existing=recreate_existing,
                       why=f"TPU VM {plan.name} is {found[0]}")
    found = None
  if found is None:
    _check(runner.run(plan.create()), "creating the TPU VM")
    return True
  _refuse_other_spec(plan, found)
  if found[0] != "READY":
    raise common.LaunchError(f"--tpu_name={plan.name} is {found[0]}; allowed: a READY TPU VM")
  return False


def _delete_if_allowed(plan, runner: Runner, created: bool, recreate_existing: bool,
                       why: str) -> None:
  """Deletes the TPU, but only one this launcher created, or when --recreate_existing says so."""
  if not (created or recreate_existing):
    raise common.LaunchError(
        f"{why} and this launcher did not create it, so it will not delete it; allowed: delete "
        "it yourself, or pass --recreate_existing to let it recreate the TPU from these flags")
  common.log(f"{why}: deleting it, to create it again from the same flags")
  _check(runner.run(plan.delete()), "deleting the TPU")


def _state_after_run(plan, runner: Runner) -> str:
  """READY, PREEMPTED (also: gone, or its queued resource suspended), or the VM's other state."""
  found = _describe_vm(plan, runner)
  if found is None or found[0] in PREEMPTED_VM_STATES:
    return "PREEMPTED"
  if plan.queued_resource:
    _, qr_state = runner.query(plan.describe_qr(), dry_answer="ACTIVE")
    if qr_state in PREEMPTED_QR_STATES:
      return "PREEMPTED"
  return found[0]


# --- Running. ------------------------------------------------------------------------------------


class Stopped(Exception):
  """The launcher was told to stop (SIGTERM / Ctrl-C) and stopped the remote trainer."""

  def __init__(self, code: int):
    super().__init__(code)
    self.code = code


def run_attempt(plan, runner: Runner, attempt: int, attach_only: bool = False) -> int:
  """Starts run `attempt` on worker 0 (unless `attach_only`) and waits for its exit status.

  SIGTERM or Ctrl-C meanwhile: `tpu_remote stop` on the VM, run to its end, then `Stopped`.
  """
  try:
    if not attach_only:
      _check(runner.run(plan.start(attempt)), "starting the trainer on worker 0")
    return runner.run(plan.wait(attempt))
  except (KeyboardInterrupt, SystemExit):
    common.log("launcher told to stop: SIGTERM to the remote trainer, waiting up to "
               f"{plan.stop_grace_s:g}s for its checkpoint (exit 42)")
    code = runner.run_to_end(plan.stop(attempt))
    common.log(f"the remote trainer exited with {common.describe_exit(code)}; not restarting")
    raise Stopped(code) from None


def launch(plan: tpu_commands.TpuPlan, runner: Runner, watch: bool, max_restarts: int,
           poll_s: float = 60, recreate_existing: bool = False,
           provision_timeout_s: float = 86400) -> int:
  """Provisions, sets up, runs and waits; with `watch`, restarts after preemptions (see above)."""
  if not plan.runtime.listed:
    common.log(f"note: {plan.runtime.image} follows the naming rule of "
               f"{tpu_runtime.RUNTIMES_DOC} but TensorFlow {plan.runtime.tf_version} is not "
               "listed there; if create fails, see `gcloud compute tpus tpu-vm versions list`")
  created = provision(plan, runner, poll_s, provision_timeout_s, recreate_existing)
  attempt = restarts = reattached = 0
  needs_setup, attach_only = True, False
  try:
    while True:
      if needs_setup:
        for what, cmd in plan.setup():
          _check(runner.run(cmd), what)
        needs_setup = False
      code = run_attempt(plan, runner, attempt, attach_only)
      attach_only = False
      if code == 0 or runner.dry_run:
        return code
      state = _state_after_run(plan, runner)
      if code == SSH_FAILED and state == "READY" and reattached < MAX_REATTACH:
        reattached += 1
        common.log(f"ssh dropped while the VM is READY; re-attaching ({reattached}/"
                   f"{MAX_REATTACH})")
        attach_only = True
        continue
      if not watch:
        return code
      if state == "READY" and code not in common.RESTART_CODES:
        common.log(f"the run failed with exit status {code}, not a preemption; not restarting")
        return code
      if state not in ("READY", "PREEMPTED"):
        common.log(f"the run ended with {code} and the VM is {state}; not restarting")
        return code
      if restarts >= max_restarts:
        common.log(f"preempted again; no restarts left (--max_restarts={max_restarts})")
        return code
      restarts += 1
      attempt += 1
      if state == "PREEMPTED":
        if not (created or recreate_existing):
          common.log(f"TPU {plan.name} was preempted; this launcher did not create it, so it "
                     "does not delete it (--recreate_existing allows that)")
          return code
        common.log(f"TPU preempted (exit {common.describe_exit(code)}); recreating it from the "
                   f"same flags, restart {restarts}/{max_restarts}")
        _check(runner.run(plan.delete()), "deleting the preempted TPU")
        created = provision(plan, runner, poll_s, provision_timeout_s, fresh=True)
        needs_setup = True
      else:
        common.log(f"the trainer exited with {common.describe_exit(code)} on a READY VM; "
                   f"starting it again, restart {restarts}/{max_restarts}")
  except Stopped as stopped:
    return stopped.code


def main(argv: Sequence[str]) -> int:
  del argv
  for name in ("max_restarts", "poll_s", "provision_timeout_s"):
    common.check_non_negative(name, getattr(FLAGS, name))
  plan = tpu_commands.TpuPlan(
      tpu_name=FLAGS.tpu_name, zone=FLAGS.zone, config=FLAGS.config, workdir=FLAGS.workdir,
      run_id=FLAGS.run_id or time.strftime("%Y%m%d-%H%M%S"), project=FLAGS.project,
      accelerator_type=FLAGS.accelerator_type, runtime_version=FLAGS.runtime_version,
      queued_resource=FLAGS.queued_resource, queued_resource_id=FLAGS.queued_resource_id,
      spot=FLAGS.spot, best_effort=FLAGS.best_effort, overrides=FLAGS.override,
      remote_dir=FLAGS.remote_dir, copy=FLAGS.copy, requirements=FLAGS.requirements,
      python=FLAGS.python, stop_grace_s=FLAGS.stop_grace_s)
  return launch(plan, Runner(FLAGS.dry_run), FLAGS.watch, FLAGS.max_restarts, FLAGS.poll_s,
                FLAGS.recreate_existing, FLAGS.provision_timeout_s)


if __name__ == "__main__":
  define_flags()
  common.run_main(main)
