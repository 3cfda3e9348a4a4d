"""Temporarily replacing Keras layers' `call` while a forward pass is recorded.

* `recording_call`: a covered layer's call that records its formulas' inputs (`layers.py`),
  or runs the layer's own call when the layer is (or is just found to be) on the general path.
* `refusing_call`: BatchNormalization with training=True refuses (batch statistics mix the
  examples).
* `patched`: sets `layer.call` on the instances for the duration of a `with` block and always
  restores what was there.
* `inner_tapes`: notes the GradientTapes and ForwardAccumulators opened inside a recorded
  forward (a loss that differentiates the model, e.g. a gradient penalty on the input).

Context: Python only, eagerly or while tracing; used by `recording.Recorder`.
"""
import contextlib
import os
import sys
import threading

import tensorflow as tf

from trainer.per_example import general

_MISSING = object()


def recording_call(layer, rule, rec):
  """The call that records `layer` (its `rule`) on `rec`; build it before patching the layer.

  It first asks whether the caller's tape records here and `rec.batch_axis` whether the input is
  per example: if not, the layer is demoted
  (`Recording.demote`) and its own call runs, as it does for the rest of the recorder's life.
  """
  original = layer.call  # Read before the patch: the layer's own call, for demoted calls.

  def call(inputs, *args, **kwargs):
    rec.inside.append(layer)  # Whose recorded call is running (see `Recording.inside`).
    try:
      if all(l is not layer for l, _ in rec.recorder.layers):  # Demoted earlier in this pass.
        return original(inputs, *args, **kwargs)
      problem = (_recording_stopped() or _under_inner_tape(rec)
                 or rec.batch_axis.problem(inputs))
      if problem:
        rec.demote(layer, problem)
        return original(inputs, *args, **kwargs)
      inputs = rec.batch_axis.checked(inputs, f"{type(layer).__name__} {layer.name}")
      return rule.call(layer, inputs, rec)
    finally:
      rec.inside.pop()
  return call


def _recording_stopped() -> str:
  """Why the caller's backward pass cannot reach this call's output, or '': gradient recording
  is stopped on this thread (eagerly the forward of `tf.custom_gradient` and
  `tf.recompute_grad`; `tape.stop_recording()`), or, traced, the call runs inside a
  `tf.custom_gradient` function, whose backward goes from its outputs straight to its inputs
  by the user's gradient. Either way the recorded output's gradient would be zero. The general
  path differentiates such layers itself."""
  try:
    from tensorflow.python import pywrap_tfe  # pylint: disable=g-import-not-at-top
    stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
  except (ImportError, AttributeError):
    stopped = False
  if stopped:
    return ("it runs while gradient recording is stopped (inside tf.custom_gradient, "
            "tf.recompute_grad or tape.stop_recording())")
  if tf.executing_eagerly():  # The stack walk below is for tracing only.
    return ""
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:  # Tracing: TF's decorator for custom gradients in graph mode.
    code = frame.f_code
    if code.co_name == "_graph_mode_decorator" and code.co_filename.endswith(_CUSTOM_GRADIENT):
      return "it runs inside a tf.custom_gradient function (its backward skips the call)"
    frame = frame.f_back
  return ""


_CUSTOM_GRADIENT = os.path.join("ops", "custom_gradient.py")


def _under_inner_tape(rec) -> str:
  """Why a tape opened inside the recorded forward makes the direct formula wrong, or ''.

  A loss that differentiates the model itself (a gradient penalty |d logits / d x|^2, a
  Jacobian-vector product) depends on the layer's variables also through that inner
  derivative; the direct formulas see only the gradient reaching the layer's output, so they
  would miss it, silently (relative errors of 0.2-1.0). The general path differentiates the
  whole loss per example."""
  if not rec.open_tapes:
    return ""
  kind = type(rec.open_tapes[-1]).__name__
  return (f"it runs under a {kind} opened inside the recorded forward (a loss that "
          "differentiates the model, e.g. a gradient penalty)")


_TAPE_CLASSES = (tf.GradientTape, tf.autodiff.ForwardAccumulator)
_hooks = threading.local()  # .blocks: the open-tape lists of this thread's `inner_tapes` blocks.
_installed = {"users": 0, "originals": {}}
_install_lock = threading.Lock()


def _blocks():
  if not hasattr(_hooks, "blocks"):
    _hooks.blocks = []
  return _hooks.blocks


def _install():
  for cls in _TAPE_CLASSES:
    enter, leave = cls.__dict__["__enter__"], cls.__dict__["__exit__"]
    _installed["originals"][cls] = (enter, leave)

    def entering(self, *args, _enter=enter, **kwargs):
      out = _enter(self, *args, **kwargs)
      for block in _blocks():
        block.append(self)
      return out

    def leaving(self, *args, _leave=leave, **kwargs):
      for block in _blocks():
        block[:] = [t for t in block if t is not self]
      return _leave(self, *args, **kwargs)
    cls.__enter__, cls.__exit__ = entering, leaving


@contextlib.contextmanager
def inner_tapes():
  """Yields the list of GradientTapes and ForwardAccumulators opened on this thread inside the
  block and still open. Their classes' `__enter__`/`__exit__` are wrapped while any such block
  runs (counted across threads; TF's own behaviour is unchanged)."""
  open_now = []
  with _install_lock:
    if _installed["users"] == 0:
      _install()
    _installed["users"] += 1
  _blocks().append(open_now)
  try:
    yield open_now
  finally:
    blocks = _blocks()
    blocks[:] = [b for b in blocks if b is not open_now]
    with _install_lock:
      _installed["users"] -= 1
      if _installed["users"] == 0:
        for cls, (enter, leave) in _installed["originals"].items():
          cls.__enter__, cls.__exit__ = enter, leave
        _installed["originals"].clear()


def training_flag(args, kwargs):
  if "training" in kwargs:
    return kwargs["training"]
  return args[1] if len(args) > 1 else None


def refusing_call(layer, original):
  def call(*args, **kwargs):
    training = training_flag(args, kwargs)
    if layer.trainable and training is not None and (not isinstance(training, bool) or training):
      raise general.Refused(
          f"per_example: BatchNormalization layer '{layer.name}' runs with training=True "
          "(batch statistics mix examples, so per-example gradients are ill-defined); set "
          "layer.trainable=False, call it with training=False (inside a functional model, Keras "
          "3 replaces that by the model call's training=True), or use LayerNormalization/"
          "GroupNormalization.")
    return original(*args, **kwargs)
  return call


@contextlib.contextmanager
def patched(replacements):
  """Temporarily sets `layer.call` for each (layer, call); always restores what was there."""
  done = []
  try:
    for layer, call in replacements:
      done.append((layer, layer.__dict__.get("call", _MISSING)))
      object.__setattr__(layer, "call", call)  # Bypasses Keras attribute tracking.
    yield
  finally:
    for layer, previous in reversed(done):
      if previous is _MISSING:
        object.__delattr__(layer, "call")
      else:
        object.__setattr__(layer, "call", previous)
