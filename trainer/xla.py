"""XLA for the replica functions: which ones `config.xla` compiles, and how (docs/design.md).

`plan(config, strategy)` resolves `config.xla` (auto | on | off) for a strategy; the trainer then
compiles the micro-step always, the whole update step where XLA has the collective (one replica,
or GPUs only), and otherwise the update's local forward/backward through `PerReplicaCompiled`.
Eager at construction; the compiled functions run traced, in replica context.
"""
from typing import NamedTuple

import tensorflow as tf

from trainer import strategies


class XlaPlan(NamedTuple):
  """Which replica functions are compiled with XLA (`jit_compile=True`).

  Attributes:
    enabled: `config.xla` resolved ("auto": on for GPUs, off on CPUs; TPUs compile anyway).
    micro_step: the micro-step (local forward, backward, buffer adds).
    update_step: the whole update step (needs XLA's collective: one replica, or GPUs only).
    local_sums: the update step's local forward/backward, when the whole step is not compiled.
  """
  enabled: bool
  micro_step: bool
  update_step: bool
  local_sums: bool


def plan(config, strategy) -> XlaPlan:
  """Resolves `config.xla` for `strategy` (eager, host)."""
  kind = strategies.device_kind(strategy)
  if kind == "tpu":  # Everything inside tpu.replicate is compiled already.
    return XlaPlan(True, False, False, False)
  enabled = config.xla == "on" or (config.xla == "auto" and kind == "gpu")
  if not enabled:
    return XlaPlan(False, False, False, False)
  whole = strategy.num_replicas_in_sync == 1 or kind == "gpu"
  return XlaPlan(True, True, whole, not whole)


class PerReplicaCompiled:
  """`fn` compiled with XLA, one `tf.function` per replica; called in replica context.

  Two TensorFlow rules shape this. A `jit_compile` tf.function handed to MirroredStrategy.run on
  non-GPU devices is lifted around ALL replicas into one XLA program, which XLA refuses (one
  device per program). And a tf.function traced in replica 0 captures replica 0's copies of the
  variables, so a second replica must not reuse its trace. Hence one compiled function per
  replica, called from the plain replica function. (On GPUs, and with a single replica, the
  trainer hands a compiled update step to `strategy.run` directly instead.)
  """

  def __init__(self, fn):
    self._fn = fn
    self._compiled = {}

  def __call__(self, *args):
    ctx = tf.distribute.get_replica_context()
    replica = 0 if ctx is None else int(tf.get_static_value(ctx.replica_id_in_sync_group))
    if replica not in self._compiled:
      self._compiled[replica] = tf.function(self._fn, jit_compile=True)
    return self._compiled[replica](*args)
