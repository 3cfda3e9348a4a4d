"""Which CPU kernels TensorFlow runs here, for the formulas whose fastest layout depends on it.

TensorFlow 2.20 on x86 runs its oneDNN kernels by default only on CPUs with AVX-512 class
features (AMD Zen 4, Intel Cascade Lake and newer); elsewhere (AVX2-only CPUs such as AMD
Zen 1-3), and wherever `TF_ENABLE_ONEDNN_OPTS=0`, it runs Eigen's. The two differ most on
batched products of many small matrices: TF's Eigen `BatchMatMul` splits EACH product over the
thread pool once it exceeds 128 x 128 multiply-adds, so a batch of 128 small products pays the
pool's hand-off 128 times, while a product with a dimension of 1 is sharded over the batch
(one thread per product, no hand-off). The per-example kernel gradient of a convolution with few
input channels is therefore faster on Eigen as one [1, T] x [T, O] product per kernel tap and
channel, and faster on oneDNN as one [T, taps * C] x [T, O] product over all patches (2x either
way on 2 cores, B = 128; docs/benchmarks.md). Every layout gives the same numbers; only speed
depends on this choice.

Python only: read while tracing, cached for the process (the kernels are fixed once TensorFlow
is imported). Tests replace `eigen_cpu` to exercise both layouts whatever the host.
"""
import functools

import tensorflow as tf


@functools.lru_cache(maxsize=None)
def onednn_on():
  """Whether TensorFlow's oneDNN CPU kernels are on in this process (None if it cannot tell).

  TF's own answer (it reads TF_ENABLE_ONEDNN_OPTS and the CPU's features), from a private module.
  """
  try:
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
    return bool(_pywrap_util_port.IsMklEnabled())
  except (ImportError, AttributeError):
    return None


@functools.lru_cache(maxsize=None)
def eigen_cpu() -> bool:
  """True when the formulas run on Eigen's CPU kernels: oneDNN known off and no GPU or TPU."""
  if onednn_on() is not False:
    return False
  return not any(tf.config.list_logical_devices(kind) for kind in ("GPU", "TPU"))
