"""XLA for the replica functions: which ones `config.xla` compiles, and how (docs/design.md).

`plan(config, strategy, model)` resolves `config.xla` (auto | on | off) for a strategy and a model
(auto stays off, as in Keras' `model.fit`, when a layer says `supports_jit = False`: lookup
tables of StringLookup and the like; `on` refuses such a model in one line); the trainer then
compiles the micro-step always, the whole update step where XLA has the collective (one replica,
or GPUs only), and otherwise the update's local forward/backward through `PerReplicaCompiled`.
Eager at construction; the compiled functions run traced, in replica context.
"""
from typing import NamedTuple

from absl import logging
import tensorflow as tf

from trainer import errors
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


def _without_jit(model) -> str:
  """'name' (Class) of the first layer Keras marks `supports_jit = False`, or ''."""
  flatten = getattr(model, "_flatten_layers", None)
  for layer in (flatten() if flatten else ()):
    if not getattr(layer, "supports_jit", True):
      return f"{layer.name!r} ({type(layer).__name__})"
  return ""


def plan(config, strategy, model=None) -> XlaPlan:
  """Resolves `config.xla` for `strategy` and `model` (eager, host)."""
  kind = strategies.device_kind(strategy)
  if kind == "tpu":  # Everything inside tpu.replicate is compiled already.
    return XlaPlan(True, False, False, False)
  enabled = config.xla == "on" or (config.xla == "auto" and kind == "gpu")
  unsupported = _without_jit(model) if enabled else ""
  if unsupported and config.xla == "on":
    raise errors.ConfigError(
        f"`xla`=on: layer {unsupported} cannot run under XLA (Keras marks it supports_jit=False); "
        "allowed: auto (then off for this model) or off")
  if unsupported:
    logging.info("xla=auto: off, layer %s does not support XLA", unsupported)
    enabled = False
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
      self._compiled[replica] = tf.function(self._fn, jit_compile=True, autograph=False)
    return self._compiled[replica](*args)
