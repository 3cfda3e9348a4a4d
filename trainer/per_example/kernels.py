"""Which CPU kernels TensorFlow runs here: oneDNN's or Eigen's. The per-example terms' speed
depends on it.

TensorFlow 2.20 on Linux x86 runs its oneDNN kernels by default only on CPUs with AVX512-VNNI,
AVX512-BF16, AVX-VNNI or AMX (AMD Zen 4, Intel Cascade Lake and newer); elsewhere (AVX2-only
CPUs such as AMD Zen 1-3, and AVX-512 ones without VNNI such as Skylake-SP), and wherever
`TF_ENABLE_ONEDNN_OPTS=0`, it runs Eigen's. The per-example convolution terms are batched
products of many small matrices, and TF's Eigen `BatchMatMul` splits EACH of them over the
thread pool once it exceeds 128 x 128 multiply-adds: the small CNN's 9 kernel taps
of [121, 32]^T x [121, 64] take 24 ms there against 15 for its batch `Conv2DBackpropFilter`
(B = 128, 2 cores), so ghost statistics cost 1.4x a batch gradient instead of 1.05x with
oneDNN (docs/benchmarks.md). Every formula gives the same numbers on either; only speed differs.

Used for the trainer's warning, the benchmarks' rows and to keep pfor away from a kernel
combination that crashes (`pfor_crashes_on`). Python only, cached for the process
(the kernels are fixed once TensorFlow is imported).
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
def cpu_only() -> bool:
  """True when this process has no GPU or TPU: every kernel runs on the CPU."""
  return not any(tf.config.list_logical_devices(kind) for kind in ("GPU", "TPU"))


def eigen_cpu() -> bool:
  """True when the formulas run on Eigen's CPU kernels: oneDNN known off and no GPU or TPU."""
  return onednn_on() is False and cpu_only()


# The ops pfor turns into batched matmuls that crash with oneDNN on (below): tf.matmul of a
# [1, T, D] example and a [D, U] weight (Keras Dense on sequences, `keras.ops.einsum`'s matmul
# forms, MultiHeadAttention's projections) killed the process at B = 4 on an Intel Xeon with
# AVX512-VNNI and AMX (2026-12-06; pure TF, no microstep); Einsum is kept with them because
# oneDNN runs it through the same batched matmul.
PFOR_CRASH_OPS = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})


def pfor_crash_possible() -> bool:
  """Whether this process runs the CPU kernels under which pfor can crash: oneDNN on (or
  unknown) and no GPU or TPU. Python only."""
  return onednn_on() is not False and cpu_only()


def pfor_crashes_on(layers) -> bool:
  """Whether `tf.vectorized_map` through a model made of `layers` is known to kill the process.

  TF 2.20 with oneDNN's CPU kernels on segfaults (SIGSEGV, B >= 2) when pfor vectorizes a
  forward pass through Keras MultiHeadAttention (its EinsumDense projections and attention
  einsums); reproduced without microstep. A cheap check by class; `op_types_in` finds the
  same ops in any layer's graph. Python only.
  """
  if not pfor_crash_possible():
    return False
  import keras  # pylint: disable=g-import-not-at-top
  attention = (keras.layers.MultiHeadAttention, keras.layers.EinsumDense)
  return any(isinstance(layer, attention) for layer in layers)


# Ops whose pfor form XLA cannot compile: pfor turns a while loop (an RNN layer's) into loops
# over TensorLists with conds on DT_VARIANT ("tf2xla conversion failed"; TF 2.20, found by a
# probe on 2026-12-07). Only at compile time, inside the compiled step: no fallback can catch it.
PFOR_XLA_FAILS_OPS = frozenset({"While", "StatelessWhile"})


def op_types_in(graph) -> frozenset:
  """The op types in `graph` (a tf.Graph), its nested functions included (while-loop bodies,
  cond branches). Python only, on a traced graph."""
  definition = graph.as_graph_def()
  nodes = list(definition.node)
  for function in definition.library.function:
    nodes.extend(function.node_def)
  return frozenset(node.op for node in nodes)


def in_xla_context() -> bool:
  """Whether the graph being traced is compiled by XLA (`jit_compile`, a TPU's replicated step);
  False eagerly."""
  if tf.executing_eagerly():
    return False
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
