"""Test-wide setup, at import time, before TensorFlow is imported or any TF op runs.

* oneDNN on: TensorFlow 2.20 turns its oneDNN kernels on by default only on x86 CPUs with
  AVX512-VNNI/BF16, AVX-VNNI or AMX (e.g. AMD Zen 4, Intel Cascade Lake and newer); on
  AVX2-only CPUs (e.g. AMD Zen 1-3) its default is off. Users on the newer CPUs get oneDNN,
  and with it the pfor crash through MultiHeadAttention that the per-example code must
  survive, so the suite runs with oneDNN on whatever the CI host is. Subprocesses inherit the setting.
* Multi-replica tests (MirroredStrategy over 2 logical CPUs) need the CPU split into two logical
  devices, which can only happen once, before TensorFlow initialises its devices.
* Each test's garbage is collected at its end. Left to Python's own collections, the TF objects
  (strategies, iterators, their threads) of many tests were torn down at once inside some later
  test: single in-process tests took 60-130 s in the full suite against seconds alone. With
  the collection per test, none of them took over 20 s and the suite took 26.6 min against
  30.1 (one run each, 2026-12-07, 2 vCPUs).
"""
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"

import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

_CPUS = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _CPUS[0], [tf.config.LogicalDeviceConfiguration()] * 2)


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test():
  yield
  gc.collect()
