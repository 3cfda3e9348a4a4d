"""Which Cloud TPU software version a TensorFlow job gets, and how its trainer reaches the TPU.

Cloud TPU names its TensorFlow images by one rule ("TPU software versions",
https://cloud.google.com/tpu/docs/runtimes):

    tpu-vm-tf-X.Y.Z[-pod][-pjrt|-se]

  X.Y.Z   the TensorFlow version the model runs with. Here it is read from the
          `tensorflow-tpu==X.Y.Z` pin of launch/requirements-tpu.txt, so the image and the wheel
          installed on top of it always agree.
  -pod    a multi-host slice (more than one TPU VM); nothing for a single host.
  -pjrt   from TF 2.15.0 the device API must be named: PJRT or StreamExecutor (`-se`).
  -se     For v5e, v5p and v6e (TF 2.15.0 and newer) the page gives `-pjrt` names only; for v2, v3
          and v4 either.

The table, one row per accelerator family (the F of `--accelerator_type=F-N`):

    family     N counts      per host   device APIs (first: default)
    v2, v3     TensorCores   8          pjrt, se
    v4         TensorCores   8          pjrt, se       (v4-8 is one VM of 4 chips)
    v5p        TensorCores   8          pjrt           (v5p-8: 4 chips, one host)
    v5litepod  chips         8          pjrt           (https://cloud.google.com/tpu/docs/v5e)
    v6e        chips         8          pjrt           (https://cloud.google.com/tpu/docs/v6e)

so `F-N` with N <= 8 is one TPU VM and N > 8 is N / 8 of them (v4-32: 4 hosts; v5litepod-16: 2,
as in the v5e page's slice table). PJRT is the default everywhere, as in Google's TensorFlow CI.

How the trainer then reaches the chips, as Google's own TensorFlow-on-TPU CI does it
(GoogleCloudPlatform/ml-auto-solutions, dags/solutions_team/configs/tensorflow/common.py,
`export_env_variables`, and xlml/apis/task.py, `all_workers=not is_pod`):

  single host, PJRT   tpu_address=local; NEXT_PLUGGABLE_DEVICE_USE_C_API=true and
                      TF_PLUGGABLE_DEVICE_LIBRARY_PATH=<the pip libtpu package>/libtpu.so.
  single host, SE     tpu_address=local; nothing else.
  pod slice           ONE client, on worker 0, with tpu_address=<the slice's name>,
                      TPU_NAME=<name> and TPU_LOAD_LIBRARY=0 (the client must not take worker 0's
                      chips: the image's TPU runtime service on every worker owns them).

What the docs do not say (checked against the stored copies of the runtimes page, 2025): its
table of TensorFlow versions stops at 2.18.0. microstep pins TensorFlow 2.20.0, so its image names
below follow the documented rule but are not listed there; `LISTED_TF_VERSIONS` records which are.
`gcloud compute tpus tpu-vm versions list --zone=ZONE` shows what a zone really offers.

Nothing here imports TensorFlow: it runs on the machine that runs gcloud.
"""
import dataclasses
import re

from launch import common

RUNTIMES_DOC = "https://cloud.google.com/tpu/docs/runtimes"

# Chips or TensorCores (the N of F-N) per TPU VM; every family in the table has 8.
UNITS_PER_HOST = 8
# family -> device APIs it accepts with TF >= 2.15, the default first.
DEVICE_APIS = {
    "v2": ("pjrt", "se"),
    "v3": ("pjrt", "se"),
    "v4": ("pjrt", "se"),
    "v5p": ("pjrt",),
    "v5litepod": ("pjrt",),
    "v6e": ("pjrt",),
}
# TensorFlow versions with images, and whether the runtimes page lists them (True) or their names
# only follow its rule (False).
LISTED_TF_VERSIONS = {
    "2.15.0": True, "2.15.1": True, "2.16.1": True, "2.16.2": True, "2.17.0": True,
    "2.17.1": True, "2.18.0": True,
    "2.20.0": False,
}
# Client environment for a single-host PJRT runtime. `{libtpu}` is the directory of the pip
# `libtpu` package on the VM; launch/tpu_remote.py fills it in there.
PJRT_ENV = (("NEXT_PLUGGABLE_DEVICE_USE_C_API", "true"),
            ("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", "{libtpu}/libtpu.so"))

_ACCELERATOR_RE = re.compile(r"^(v[0-9][a-z]*)-([1-9][0-9]*)$")


@dataclasses.dataclass(frozen=True)
class Runtime:
  """The software a TPU slice runs and how the trainer addresses it.

  Attributes:
    accelerator_type: e.g. `v4-32`.
    family: e.g. `v4`.
    hosts: TPU VMs in the slice (`gcloud ... --worker` numbers 0..hosts-1).
    tf_version: e.g. `2.20.0`.
    device_api: `pjrt` or `se`.
    image: the `--version` / `--runtime-version` to create the TPU with.
    listed: whether the runtimes page lists this TensorFlow version (see module docstring).
  """
  accelerator_type: str
  family: str
  hosts: int
  tf_version: str
  device_api: str
  image: str
  listed: bool

  @property
  def pod(self) -> bool:
    return self.hosts > 1

  @property
  def pjrt(self) -> bool:
    return self.device_api == "pjrt"

  def client(self, tpu_name: str) -> tuple[str, list[tuple[str, str]]]:
    """(tpu_address, environment) of the one trainer process, which runs on worker 0."""
    if self.pod:
      return tpu_name, [("TPU_NAME", tpu_name), ("TPU_LOAD_LIBRARY", "0")]
    return "local", list(PJRT_ENV) if self.pjrt else []


def image_name(tf_version: str, pod: bool, device_api: str) -> str:
  """`tpu-vm-tf-X.Y.Z[-pod]-{pjrt|se}`, the runtimes page's rule for TF 2.15.0 and newer."""
  return f"tpu-vm-tf-{tf_version}{'-pod' if pod else ''}-{device_api}"


def parse_accelerator_type(accelerator_type: str) -> tuple[str, int]:
  """`v4-32` -> ("v4", 4 hosts); refuses families and sizes outside the table."""
  allowed = (f"allowed: F-N with F one of {', '.join(DEVICE_APIS)} and N <= {UNITS_PER_HOST} "
             f"or a multiple of {UNITS_PER_HOST}, e.g. v4-8, v5litepod-8, v4-32")
  match = _ACCELERATOR_RE.match(accelerator_type or "")
  if not match or match.group(1) not in DEVICE_APIS:
    raise common.LaunchError(f"--accelerator_type={accelerator_type} is unknown; {allowed}")
  units = int(match.group(2))
  if units > UNITS_PER_HOST and units % UNITS_PER_HOST:
    raise common.LaunchError(f"--accelerator_type={accelerator_type} does not fill whole TPU VMs "
                             f"of {UNITS_PER_HOST}; {allowed}")
  return match.group(1), max(1, units // UNITS_PER_HOST)


def choose(accelerator_type: str, tf_version: str, runtime_version: str = "") -> Runtime:
  """The runtime for this slice and TensorFlow version; `runtime_version` (the flag) may only
  pick among the images the table allows, e.g. `-se` instead of `-pjrt` on v4."""
  family, hosts = parse_accelerator_type(accelerator_type)
  if tf_version not in LISTED_TF_VERSIONS:
    raise common.LaunchError(
        f"--requirements pins tensorflow-tpu=={tf_version}, which has no TPU runtime in "
        f"launch/tpu_runtime.py; allowed: {', '.join(LISTED_TF_VERSIONS)}")
  allowed = {image_name(tf_version, hosts > 1, api): api for api in DEVICE_APIS[family]}
  if runtime_version and runtime_version not in allowed:
    raise common.LaunchError(
        f"--runtime_version={runtime_version} does not fit --accelerator_type={accelerator_type} "
        f"with TensorFlow {tf_version}; allowed: {', '.join(allowed)} ({RUNTIMES_DOC})")
  image = runtime_version or next(iter(allowed))
  return Runtime(accelerator_type=accelerator_type, family=family, hosts=hosts,
                 tf_version=tf_version, device_api=allowed[image], image=image,
                 listed=LISTED_TF_VERSIONS[tf_version])
