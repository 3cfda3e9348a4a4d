"""Keras 3 optimizers and the learning-rate schedule, counted in optimizer updates.

The schedule is called with `optimizer.iterations`, which microstep advances once per applied
update (never per micro-step), so warm-up and decay see updates. Clipping is NOT configured on the
Keras optimizer: Keras clips before its own all-reduce (per replica); microstep clips the reduced
gradient itself (`trainer.update.finalize_gradients`). Built eagerly under the strategy scope.

microstep applies gradients in replica context (`trainer.update.apply_or_skip`) after reducing
them itself; `skip_keras_all_reduce` stops Keras from reducing them a second time.
"""
import math

import keras
import tensorflow as tf

OPTIMIZERS = ("sgd", "adam", "adamw")


@keras.saving.register_keras_serializable(package="microstep")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
  """Linear warm-up from 0 over `warmup_steps` updates, then constant or cosine decay to 0.

  lr(t) = base * min(1, (t + 1) / warmup) * decay(t), where t counts applied updates from 0.
  """

  def __init__(self, base: float, warmup_steps: int, decay: str, total_steps: int):
    self.base, self.warmup_steps, self.decay, self.total_steps = base, warmup_steps, decay, total_steps

  def __call__(self, step):
    step = tf.cast(step, tf.float32)
    lr = tf.constant(self.base, tf.float32)
    if self.warmup_steps > 0:
      lr *= tf.minimum(1.0, (step + 1.0) / float(self.warmup_steps))
    if self.decay == "cosine":
      span = float(max(self.total_steps - self.warmup_steps, 1))
      progress = tf.clip_by_value((step - self.warmup_steps) / span, 0.0, 1.0)
      lr *= 0.5 * (1.0 + tf.cos(math.pi * progress))
    return lr

  def get_config(self):
    return {"base": self.base, "warmup_steps": self.warmup_steps, "decay": self.decay,
            "total_steps": self.total_steps}


def learning_rate(opt_config, total_steps: int):
  """Always a schedule, a constant rate too: with a float, Keras keeps the rate in a variable
  that the checkpoint holds, so a resume that added or dropped warm-up or decay (a change
  docs/robustness.md calls free) was refused as another model (found by a probe, 2026-12-07).
  A checkpoint written with that variable still restores (it is then left unread)."""
  return WarmupSchedule(float(opt_config.learning_rate), int(opt_config.warmup_steps),
                        opt_config.decay, int(total_steps))


def create_optimizer(opt_config, total_steps: int, global_clipnorm_in_keras: bool = False):
  """Returns the Keras optimizer `opt_config.name` (eager, under the strategy scope).

  `global_clipnorm_in_keras` exists for reference computations in tests (single device), where
  Keras' own clipping is correct; the trainer leaves it off and clips the reduced gradient.
  """
  lr = learning_rate(opt_config, total_steps)
  common = {"learning_rate": lr, "weight_decay": opt_config.weight_decay or None}
  if global_clipnorm_in_keras and opt_config.global_clipnorm:
    common["global_clipnorm"] = opt_config.global_clipnorm
  name = opt_config.name
  if name == "sgd":
    return keras.optimizers.SGD(momentum=opt_config.momentum, nesterov=opt_config.nesterov, **common)
  if name == "adam":
    return keras.optimizers.Adam(beta_1=opt_config.beta_1, beta_2=opt_config.beta_2,
                                 epsilon=opt_config.epsilon, **common)
  if name == "adamw":
    common["weight_decay"] = opt_config.weight_decay
    return keras.optimizers.AdamW(beta_1=opt_config.beta_1, beta_2=opt_config.beta_2,
                                  epsilon=opt_config.epsilon, **common)
  raise ValueError(f"`optimizer.name`={name!r} unknown; allowed: {', '.join(OPTIMIZERS)}")


# Keras 3.x (keras/src/backend/tensorflow/optimizer.py): `TFOptimizer._backend_update_step`
# passes the gradients through this method, which SUM-all-reduces them when called in replica
# context. microstep has already reduced them in its one packed all-reduce.
_KERAS_ALL_REDUCE_HOOK = "_all_reduce_sum_gradients"


class KerasInternalsChanged(RuntimeError):
  """The Keras private hook microstep relies on is gone or no longer used: fail loudly."""


def skip_keras_all_reduce(optimizer):
  """Makes `optimizer` apply gradients as given, without its own all-reduce (eager, once).

  Replaces the instance's `_all_reduce_sum_gradients` with an identity that counts its calls
  (`optimizer.microstep_hook_calls`), so `check_keras_all_reduce_skipped` can prove after tracing
  that Keras still routes gradients through it. Raises KerasInternalsChanged if the hook is gone.
  """
  if not callable(getattr(type(optimizer), _KERAS_ALL_REDUCE_HOOK, None)):
    raise KerasInternalsChanged(
        f"keras {keras.__version__}: {type(optimizer).__name__} has no {_KERAS_ALL_REDUCE_HOOK}; "
        "microstep needs it to stop Keras from all-reducing gradients a second time. Pin "
        "keras to a version microstep supports (3.x up to 3.15 tested).")
  optimizer.microstep_hook_calls = 0

  def as_given(grads_and_vars):
    optimizer.microstep_hook_calls += 1
    return list(grads_and_vars)
  object.__setattr__(optimizer, _KERAS_ALL_REDUCE_HOOK, as_given)  # Bypasses Keras tracking.
  return optimizer


def check_keras_all_reduce_skipped(optimizer) -> None:
  """After an apply was traced: raises KerasInternalsChanged if Keras bypassed the hook."""
  if getattr(optimizer, "microstep_hook_calls", 0) == 0:
    raise KerasInternalsChanged(
        f"keras {keras.__version__} applied gradients without calling "
        f"{_KERAS_ALL_REDUCE_HOOK}: it may all-reduce them a second time. Pin keras to a version "
        "microstep supports (3.x up to 3.15 tested).")
