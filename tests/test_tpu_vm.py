"""Tests of the TPU VM launcher (launch/tpu_vm.py, launch/tpu_commands.py), all without a network.

Three kinds:
  * dry runs: the exact gcloud command sequence for a single host (v4-8), a PJRT-only family
    (v5litepod-8) and a pod slice (v4-32), compared argument by argument;
  * the run loop against `FakeGcloud`, an in-process stand-in that answers state queries and
    records every command (preemption, --watch, spec checks, SIGTERM/Ctrl-C);
  * the real program receiving SIGTERM mid-run, with a fake `gcloud` executable on PATH.
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
from launch import tpu_commands
from launch import tpu_vm
from test_launch import assert_one_line_error  # pylint: disable=g-bad-import-order
from test_launch import dry_run_lines
from test_launch import launcher

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = sys.executable
CONFIG = "configs/fashion_mnist.py"
ARGS = ("--tpu_name=fm", "--zone=us-central2-b", "--project=proj", f"--config={CONFIG}",
        "--workdir=gs://bucket/fm", "--run_id=t1")

# --- The commands, as argv lists. ---

WHERE = ["--zone=us-central2-b", "--project=proj"]
DESCRIBE_VM = ["--format=value(state,acceleratorType,runtimeVersion,schedulingConfig.spot)"]
PJRT_ENV = ["--env=NEXT_PLUGGABLE_DEVICE_USE_C_API=true",
            "--env=TF_PLUGGABLE_DEVICE_LIBRARY_PATH={libtpu}/libtpu.so"]


def vm(verb, *args):
  return ["gcloud", "compute", "tpus", "tpu-vm", verb, "fm", *WHERE, *args]


def qr(verb, *args):
  return ["gcloud", "compute", "tpus", "queued-resources", verb, "fm-qr", *WHERE, *args]


def on_worker(worker, remote, *extra):
  return vm("ssh", f"--worker={worker}", *extra, f"--command=cd ~/microstep && {remote}")


def agent(*args):
  return shlex.join(["python3", "-m", "launch.tpu_remote", *args])


def trainer(tpu_address, *overrides):
  return ["python3", "-m", "trainer.main", f"--config={CONFIG}", "--workdir=gs://bucket/fm",
          "--config.strategy=tpu", f"--config.tpu_address={tpu_address}", *overrides]


SETUP = [
    vm("ssh", "--worker=all", "--command=mkdir -p ~/microstep"),
    ["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse", "trainer", "configs", "launch",
     "fm:~/microstep/", *WHERE, "--worker=all"],
    on_worker("all", "python3 -m pip install -r launch/requirements-tpu.txt && python3 -m pip "
              "install --no-deps 'tf-models-official~=2.20.0' 'tf-keras~=2.20.0'"),
]


def run_on_client(tpu_address, env, *overrides):
  """check, start and wait on worker 0, the trainer's only host."""
  return [
      on_worker("0", agent("check", f"--tpu={tpu_address}", *env)),
      on_worker("0", agent("start", "--run_id=t1-0", "--grace_s=600", *env, "--",
                           *trainer(tpu_address, *overrides))),
      on_worker("0", agent("wait", "--run_id=t1-0"), "--ssh-flag=-oServerAliveInterval=60"),
  ]


def dry_run_argvs(*args):
  lines = dry_run_lines("tpu_vm", *ARGS, *args)
  argvs = [shlex.split(line) for line in lines]
  assert [shlex.join(a) for a in argvs] == lines  # Each line pastes into a shell as printed.
  return argvs


# --- Dry runs. ---


def test_v4_8_single_host_dry_run_creates_tf_pjrt_runtime_installs_checks_and_runs_locally():
  assert dry_run_argvs("--accelerator_type=v4-8") == [
      vm("describe", *DESCRIBE_VM),
      vm("create", "--accelerator-type=v4-8", "--version=tpu-vm-tf-2.20.0-pjrt"),
      *SETUP,
      *run_on_client("local", PJRT_ENV),
  ]


def test_v5litepod_8_dry_run_is_a_pjrt_queued_resource():
  assert dry_run_argvs("--accelerator_type=v5litepod-8", "--queued_resource", "--spot",
                       "--watch", "--override=batch_size=1024") == [
      qr("describe", "--format=value(state.state)"),
      qr("create", "--node-id=fm", "--accelerator-type=v5litepod-8",
         "--runtime-version=tpu-vm-tf-2.20.0-pjrt", "--spot"),
      qr("describe", "--format=value(state.state)"),
      *SETUP,
      *run_on_client("local", PJRT_ENV, "--config.batch_size=1024"),
  ]


def test_v4_32_pod_dry_run_has_one_client_on_worker_0_addressing_the_slice_by_name():
  argvs = dry_run_argvs("--accelerator_type=v4-32")
  assert argvs == [
      vm("describe", *DESCRIBE_VM),
      vm("create", "--accelerator-type=v4-32", "--version=tpu-vm-tf-2.20.0-pod-pjrt"),
      *SETUP,  # Code and pins on every worker...
      *run_on_client("fm", ["--env=TPU_NAME=fm", "--env=TPU_LOAD_LIBRARY=0"]),  # ...one client.
  ]
  assert [a[8] for a in argvs if "trainer.main" in a[-1]] == ["--worker=0"]


def test_v4_8_stream_executor_runtime_gets_no_pjrt_environment():
  argvs = dry_run_argvs("--runtime_version=tpu-vm-tf-2.20.0-se")
  assert argvs[1] == vm("create", "--accelerator-type=v4-8", "--version=tpu-vm-tf-2.20.0-se")
  assert argvs[-3:] == run_on_client("local", [])


def test_best_effort_uses_gcloud_alpha():
  argvs = dry_run_argvs("--queued_resource", "--best_effort", "--queued_resource_id=my-qr")
  assert argvs[1][:7] == ["gcloud", "alpha", "compute", "tpus", "queued-resources", "create",
                          "my-qr"]
  assert argvs[1][-1] == "--best-effort"


def test_unlisted_tensorflow_version_is_named_on_stderr_only():
  done = launcher("tpu_vm", *ARGS, "--dry_run")
  assert done.returncode == 0
  assert done.stderr.strip().splitlines() == [
      "[launch] note: tpu-vm-tf-2.20.0-pjrt follows the naming rule of "
      "https://cloud.google.com/tpu/docs/runtimes but TensorFlow 2.20.0 is not listed there; if "
      "create fails, see `gcloud compute tpus tpu-vm versions list`"]


@pytest.mark.parametrize("args, needles", [
    (["--workdir=/tmp/fm"], ["--workdir=/tmp/fm", "gs://"]),
    (["--queued_resource", "--spot", "--best_effort"], ["--spot", "--best_effort"]),
    (["--best_effort"], ["--best_effort needs --queued_resource"]),
    (["--tpu_name="], ["--tpu_name is required"]),
    (["--override=tpu_address=grpc://x"], ["--override=tpu_address=grpc://x", "local"]),
    (["--accelerator_type=v4-32", "--override=tpu_address=local"],
     ["--override=tpu_address=local", "config.tpu_address=fm"]),
    (["--requirements=launch/none.txt"], ["--requirements=", "none.txt"]),
    (["--requirements=launch/requirements-gpu.txt"],
     ["must pin tensorflow-tpu exactly once", "allowed: tensorflow-tpu==X.Y.Z"]),
    (["--accelerator_type=v5litepod-8", "--runtime_version=tpu-ubuntu2204-base"],
     ["--runtime_version=tpu-ubuntu2204-base", "allowed: tpu-vm-tf-2.20.0-pjrt"]),
    (["--accelerator_type=v9-8"], ["--accelerator_type=v9-8 is unknown", "allowed:"]),
    (["--stop_grace_s=0"], ["--stop_grace_s=0", "allowed"]),
])
def test_invalid_flags_fail_with_one_line(args, needles):
  assert_one_line_error(launcher("tpu_vm", *ARGS, *args, "--dry_run"), *needles)


def test_requirements_pin_tensorflow_tpu_and_libtpu_from_tensorflows_index():
  tpu = (REPO_ROOT / "launch" / "requirements-tpu.txt").read_text().splitlines()
  gpu = (REPO_ROOT / "launch" / "requirements-gpu.txt").read_text().splitlines()
  assert "-f https://storage.googleapis.com/libtpu-tf-releases/index.html" in tpu
  assert "tensorflow-tpu==2.20.0" in tpu and "libtpu==0.0.14" in tpu
  assert tpu_commands.read_requirements("launch/requirements-tpu.txt") == (
      "2.20.0", ["tf-models-official~=2.20.0", "tf-keras~=2.20.0"])
  # Nothing installed *with* dependencies may pull the plain `tensorflow` wheel.
  installed = [l for l in tpu if l.strip() and not l.startswith(("#", "-"))]
  pulls_tensorflow = ("tensorflow=", "tensorflow~", "tensorflow[", "tf-models", "tf-keras")
  assert not any(l.startswith(pulls_tensorflow) for l in installed), installed
  assert "tensorflow[and-cuda]~=2.20.0" in gpu
  assert not any("tensorflow-tpu" in l for l in gpu)


# --- The run loop, against a fake gcloud. ---


class FakeGcloud(tpu_vm.Runner):
  """Answers like gcloud for TPU `fm` and records what ran (`calls`, `commands`).

  `vm`: the describe fields (state, accelerator, image, spot) of an existing VM, or None.
  Each `wait` returns the next of `wait_codes` and leaves the VM in the next of `states_after`.
  """

  def __init__(self, wait_codes, vm_fields=None, states_after=(), check_code=0,
               interrupt_wait=False, stop_code=42):
    super().__init__(dry_run=False, sleep=lambda s: None)
    self.wait_codes, self.states_after = list(wait_codes), list(states_after)
    self.vm, self.qr_state = vm_fields, None
    self.check_code, self.interrupt_wait, self.stop_code = check_code, interrupt_wait, stop_code
    self.calls, self.commands = [], []

  @staticmethod
  def name(cmd):
    text = cmd.shell()
    for needle, name in [("tpu_remote check", "check"), ("tpu_remote start", "start"),
                         ("tpu_remote wait", "wait"), ("tpu_remote stop", "stop"),
                         ("pip install", "install"), ("mkdir -p", "mkdir"), (" scp ", "scp")]:
      if needle in text:
        return name
    verb = cmd.argv[4 + ("alpha" in cmd.argv)]  # gcloud [alpha] compute tpus GROUP VERB
    return f"{'qr' if 'queued-resources' in cmd.argv else 'vm'}-{verb}"

  def run(self, cmd):
    name = self._record(cmd)
    if name == "wait":
      if self.interrupt_wait:
        raise KeyboardInterrupt
      if self.states_after:
        self.vm = (self.states_after.pop(0),) + tuple(self.vm[1:])
      return self.wait_codes.pop(0)
    if name == "check":
      return self.check_code
    if name.endswith("create"):
      accelerator = next(a for a in cmd.argv if a.startswith("--accelerator-type="))
      image = next(a for a in cmd.argv if a.startswith(("--version=", "--runtime-version=")))
      self.vm = ("READY", accelerator.split("=")[1], image.split("=")[1],
                 "True" if "--spot" in cmd.argv else "")
      self.qr_state = "ACTIVE" if name == "qr-create" else self.qr_state
    if name.endswith("delete"):
      self.vm = self.qr_state = None
    return 0

  def run_to_end(self, cmd):
    self._record(cmd)
    return self.stop_code

  def query(self, cmd, dry_answer=None):
    name = self._record(cmd)
    if name == "qr-describe":
      return (0, self.qr_state) if self.qr_state else (1, "")
    return (0, "\t".join(self.vm)) if self.vm else (1, "")

  def _record(self, cmd):
    name = self.name(cmd)
    self.calls.append(name)
    self.commands.append(cmd)
    return name


def plan(**kwargs):
  return tpu_commands.TpuPlan("fm", "us-central2-b", CONFIG, "gs://bucket/fm", "t1", **kwargs)


SETUP_CALLS = ["mkdir", "scp", "install", "check"]
EXISTING_V4_8 = ("READY", "v4-8", "tpu-vm-tf-2.20.0-pjrt", "")


def test_watch_recreates_a_queued_resource_it_created_from_the_same_flags():
  job = plan(queued_resource=True, spot=True)
  fake = FakeGcloud([42, 0], states_after=["PREEMPTED"])
  assert tpu_vm.launch(job, fake, watch=True, max_restarts=2) == 0
  assert fake.calls == (
      ["qr-describe", "qr-create", "qr-describe"] + SETUP_CALLS + ["start", "wait", "vm-describe"] +
      ["qr-delete", "qr-create", "qr-describe"] + SETUP_CALLS + ["start", "wait"])
  creates = [c for c in fake.commands if FakeGcloud.name(c) == "qr-create"]
  assert creates[0] == creates[1] == job.create()  # Exactly the given spec, both times.
  assert "--run_id=t1-1" in fake.commands[-1].argv[-1]


def test_watch_never_deletes_a_preempted_tpu_it_did_not_create(capsys):
  fake = FakeGcloud([255], vm_fields=EXISTING_V4_8, states_after=["PREEMPTED"])
  assert tpu_vm.launch(plan(), fake, watch=True, max_restarts=3) == 255
  assert fake.calls == ["vm-describe"] + SETUP_CALLS + ["start", "wait", "vm-describe"]
  assert "did not create it, so it does not delete it (--recreate_existing" in (
      capsys.readouterr().err)


def test_recreate_existing_lets_watch_recreate_it_from_the_flags():
  job = plan()
  fake = FakeGcloud([255, 0], vm_fields=EXISTING_V4_8, states_after=["PREEMPTED", "READY"])
  assert tpu_vm.launch(job, fake, watch=True, max_restarts=3, recreate_existing=True) == 0
  assert fake.calls == (["vm-describe"] + SETUP_CALLS + ["start", "wait", "vm-describe"] +
                        ["vm-delete", "vm-create"] + SETUP_CALLS + ["start", "wait"])
  assert fake.commands[fake.calls.index("vm-create")] == job.create()


def test_existing_tpu_with_another_spec_is_refused_with_one_line():
  fake = FakeGcloud([0], vm_fields=("READY", "v4-32", "tpu-ubuntu2204-base", "True"))
  with pytest.raises(common.LaunchError) as raised:
    tpu_vm.launch(plan(), fake, watch=True, max_restarts=3)
  assert str(raised.value) == (
      "--tpu_name=fm exists as v4-32 with tpu-ubuntu2204-base (spot), but the flags ask for "
      "--accelerator_type=v4-8 with tpu-vm-tf-2.20.0-pjrt; allowed: flags that match it, or "
      "another --tpu_name")
  assert fake.calls == ["vm-describe"]


def test_exit_42_on_a_ready_vm_restarts_there_without_setup_or_recreation():
  fake = FakeGcloud([42, 0], vm_fields=EXISTING_V4_8)
  assert tpu_vm.launch(plan(), fake, watch=True, max_restarts=1) == 0
  assert fake.calls == (["vm-describe"] + SETUP_CALLS +
                        ["start", "wait", "vm-describe", "start", "wait"])


def test_ssh_drop_on_a_ready_vm_reattaches_without_a_second_start():
  fake = FakeGcloud([255, 7], vm_fields=EXISTING_V4_8)
  assert tpu_vm.launch(plan(), fake, watch=False, max_restarts=0) == 7
  assert fake.calls == (["vm-describe"] + SETUP_CALLS +
                        ["start", "wait", "vm-describe", "wait", "vm-describe"])


def test_a_crash_is_never_restarted():
  fake = FakeGcloud([1], vm_fields=EXISTING_V4_8)
  assert tpu_vm.launch(plan(), fake, watch=True, max_restarts=3) == 1
  assert fake.calls == ["vm-describe"] + SETUP_CALLS + ["start", "wait", "vm-describe"]


def test_failed_install_check_stops_before_training_with_one_line():
  fake = FakeGcloud([0], vm_fields=EXISTING_V4_8, check_code=3)
  with pytest.raises(common.LaunchError, match="^checking that TensorFlow sees the TPU failed "
                     "with exit status 3 "):
    tpu_vm.launch(plan(), fake, watch=True, max_restarts=3)
  assert "start" not in fake.calls


def test_ctrl_c_during_the_run_stops_the_remote_trainer_and_returns_its_42():
  fake = FakeGcloud([], vm_fields=EXISTING_V4_8, interrupt_wait=True, stop_code=42)
  assert tpu_vm.launch(plan(), fake, watch=True, max_restarts=3) == 42
  assert fake.calls[-3:] == ["start", "wait", "stop"]
  remote = fake.commands[-1].argv[-1]
  assert remote == "--command=cd ~/microstep && " + agent("stop", "--run_id=t1-0",
                                                         "--grace_s=600")
  assert "--worker=0" in fake.commands[-1].argv


# --- The real launcher, a fake gcloud on PATH, and a real SIGTERM. ---

FAKE_GCLOUD = """#!{python}
import json, os, sys, time
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as log:
  log.write(json.dumps(sys.argv[1:]) + "\\n")
command = sys.argv[-1]
if "describe" in sys.argv:
  print("READY\\tv4-8\\ttpu-vm-tf-2.20.0-pjrt\\t")
elif "tpu_remote wait" in command:
  with open(os.environ["FAKE_GCLOUD_WAITING"], "w") as f:
    f.write(str(os.getppid()))  # The launcher: the test signals it.
  time.sleep(30)
elif "tpu_remote stop" in command:
  print("stopping run t1-0: SIGTERM to trainer pid 4242")
  sys.exit(42)
"""


def test_sigterm_to_the_launcher_mid_run_sends_the_remote_stop(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  gcloud = bin_dir / "gcloud"
  gcloud.write_text(FAKE_GCLOUD.format(python=PY))
  gcloud.chmod(0o755)
  log, waiting = tmp_path / "calls.jsonl", tmp_path / "waiting"
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             FAKE_GCLOUD_LOG=str(log), FAKE_GCLOUD_WAITING=str(waiting))
  proc = subprocess.Popen(["timeout", "-k", "5", "90", PY, "-m", "launch.tpu_vm", *ARGS],
                          cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 60
    while not waiting.exists() or not waiting.read_text():
      assert proc.poll() is None, proc.communicate()
      assert time.monotonic() < deadline, "the launcher never reached `wait`"
      time.sleep(0.1)
    os.kill(int(waiting.read_text()), signal.SIGTERM)  # The launcher, mid-run.
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 42, err
  calls = [json.loads(line) for line in log.read_text().splitlines()]
  assert [c[3] for c in calls] == ["describe", "ssh", "scp", "ssh", "ssh", "ssh", "ssh", "ssh"]
  assert "tpu_remote wait --run_id=t1-0" in calls[-2][-1]
  assert calls[-1][-1] == "--command=cd ~/microstep && " + agent(
      "stop", "--run_id=t1-0", "--grace_s=600")
  assert "--worker=0" in calls[-1]
  assert "launcher told to stop: SIGTERM to the remote trainer" in err
  assert "the remote trainer exited with 42 (preempted, checkpoint written)" in err
