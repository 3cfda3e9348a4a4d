"""Unit tests of the TPU runtime table (launch/tpu_runtime.py) and its one-line refusals."""
import re

import pytest

from launch import common
from launch import tpu_runtime

# The runtimes page's rule for TensorFlow 2.15.0 and newer: tpu-vm-tf-X.Y.Z[-pod]-{pjrt|se}.
DOCUMENTED_NAME = re.compile(r"^tpu-vm-tf-\d+\.\d+\.\d+(-pod)?-(pjrt|se)$")


@pytest.mark.parametrize("accelerator, image, hosts, api", [
    ("v4-8", "tpu-vm-tf-2.20.0-pjrt", 1, "pjrt"),
    ("v5litepod-8", "tpu-vm-tf-2.20.0-pjrt", 1, "pjrt"),
    ("v5litepod-4", "tpu-vm-tf-2.20.0-pjrt", 1, "pjrt"),
    ("v6e-8", "tpu-vm-tf-2.20.0-pjrt", 1, "pjrt"),
    ("v5p-8", "tpu-vm-tf-2.20.0-pjrt", 1, "pjrt"),
    ("v4-32", "tpu-vm-tf-2.20.0-pod-pjrt", 4, "pjrt"),
    ("v5litepod-16", "tpu-vm-tf-2.20.0-pod-pjrt", 2, "pjrt"),
    ("v3-32", "tpu-vm-tf-2.20.0-pod-pjrt", 4, "pjrt"),
])
def test_default_runtime_per_accelerator(accelerator, image, hosts, api):
  runtime = tpu_runtime.choose(accelerator, "2.20.0")
  assert (runtime.image, runtime.hosts, runtime.device_api) == (image, hosts, api)
  assert runtime.pod == (hosts > 1)
  assert DOCUMENTED_NAME.match(runtime.image)


def test_every_family_and_version_yields_a_documented_name():
  for family, apis in tpu_runtime.DEVICE_APIS.items():
    for version in tpu_runtime.LISTED_TF_VERSIONS:
      for units in (8, 32):
        for api in apis:
          image = tpu_runtime.image_name(version, units > 8, api)
          runtime = tpu_runtime.choose(f"{family}-{units}", version, image)
          assert DOCUMENTED_NAME.match(runtime.image) and runtime.device_api == api


def test_v4_may_choose_stream_executor_and_then_needs_no_pjrt_env():
  runtime = tpu_runtime.choose("v4-8", "2.20.0", "tpu-vm-tf-2.20.0-se")
  assert (runtime.device_api, runtime.pjrt) == ("se", False)
  assert runtime.client("fm") == ("local", [])


def test_client_environment_single_host_pjrt_and_pod():
  single = tpu_runtime.choose("v5litepod-8", "2.20.0")
  assert single.client("fm") == ("local", [
      ("NEXT_PLUGGABLE_DEVICE_USE_C_API", "true"),
      ("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", "{libtpu}/libtpu.so")])
  pod = tpu_runtime.choose("v4-32", "2.20.0")
  assert pod.client("my-slice") == ("my-slice", [("TPU_NAME", "my-slice"),
                                                 ("TPU_LOAD_LIBRARY", "0")])


def test_listed_versions_are_marked():
  assert tpu_runtime.choose("v4-8", "2.18.0").listed
  assert not tpu_runtime.choose("v4-8", "2.20.0").listed


def one_line_refusal(*args):
  with pytest.raises(common.LaunchError) as raised:
    tpu_runtime.choose(*args)
  message = str(raised.value)
  assert "\n" not in message
  return message


@pytest.mark.parametrize("runtime_version, allowed", [
    ("tpu-ubuntu2204-base", "allowed: tpu-vm-tf-2.20.0-pjrt ("),        # The old default.
    ("v2-alpha-tpuv5-lite", "allowed: tpu-vm-tf-2.20.0-pjrt ("),        # JAX/PyTorch image.
    ("tpu-vm-tf-2.20.0-se", "allowed: tpu-vm-tf-2.20.0-pjrt ("),        # v5e needs PJRT.
    ("tpu-vm-tf-2.20.0-pod-pjrt", "allowed: tpu-vm-tf-2.20.0-pjrt ("),  # One host, not a pod.
    ("tpu-vm-tf-2.18.0-pjrt", "allowed: tpu-vm-tf-2.20.0-pjrt ("),      # Not the TF pin.
])
def test_mismatched_image_is_refused_naming_flag_and_allowed_values(runtime_version, allowed):
  message = one_line_refusal("v5litepod-8", "2.20.0", runtime_version)
  assert message.startswith(f"--runtime_version={runtime_version} does not fit "
                            "--accelerator_type=v5litepod-8 with TensorFlow 2.20.0; ")
  assert allowed in message and tpu_runtime.RUNTIMES_DOC in message


def test_pod_refuses_a_single_host_image_and_lists_both_apis_on_v4():
  message = one_line_refusal("v4-32", "2.20.0", "tpu-vm-tf-2.20.0-pjrt")
  assert "allowed: tpu-vm-tf-2.20.0-pod-pjrt, tpu-vm-tf-2.20.0-pod-se (" in message


@pytest.mark.parametrize("accelerator, needle", [
    ("v7-8", "--accelerator_type=v7-8 is unknown; allowed: F-N with F one of v2, v3, v4"),
    ("tpu-8", "--accelerator_type=tpu-8 is unknown"),
    ("v4", "--accelerator_type=v4 is unknown"),
    ("v4-12", "--accelerator_type=v4-12 does not fill whole TPU VMs of 8"),
])
def test_unknown_accelerator_is_refused(accelerator, needle):
  assert needle in one_line_refusal(accelerator, "2.20.0")


def test_tensorflow_version_without_a_runtime_is_refused():
  message = one_line_refusal("v4-8", "2.19.0")
  assert message.startswith("--requirements pins tensorflow-tpu==2.19.0, which has no TPU runtime")
  assert "allowed: 2.15.0, " in message and message.endswith("2.18.0, 2.20.0")
