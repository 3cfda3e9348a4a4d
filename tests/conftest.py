"""Test-wide setup: split the CPU into two logical devices before any TF op runs.

Multi-replica tests (MirroredStrategy over 2 logical CPUs) need the split, and it can only happen
once, before TensorFlow initialises its devices, so it lives here at import time.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

_CPUS = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _CPUS[0], [tf.config.LogicalDeviceConfiguration()] * 2)
