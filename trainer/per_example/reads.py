"""Variable reads during a recorded forward pass that the direct formulas would miss.

A covered layer's per-example terms describe the uses of its variables inside its own recorded
call. Two other kinds of read make them incomplete, silently:
* a read outside that call, by other code: weights tied through another layer (an output
  projection through the embedding matrix), a regulariser in the loss. `outside_calls` notes
  them (per owning layer); the recorder then demotes the layer to the general path.
* a read with no recorded call at all: the forward ran code traced before the recording began
  (a `tf.function` around the loss or the model's call reuses its graph without running the
  Python that records), so the terms would be zeros. `unrecorded` finds them, from TensorFlow's
  own record of the trainable variables read in the block (a call of an already-traced
  function reports the variables it captures).

Context: Python-level hooks active while a recorded forward runs (eagerly, or while tracing);
they create no ops.
"""
import contextlib
import inspect

import keras

from trainer.per_example import general
from trainer.per_example import layers


@contextlib.contextmanager
def outside_calls(recorder, recording):
  """Yields {id(layer): (layer, [variable paths])}: reads of a recorded layer's variables made
  outside its own recorded call, filled while the block runs (patches `keras.Variable.value`)."""
  owners = {}
  for layer, rule in recorder.layers:
    for variable in layers.layer_variables(layer, rule):
      owners.setdefault(id(variable), layer)
  found = {}
  cls = keras.Variable
  own = cls.__dict__.get("value")
  prop = inspect.getattr_static(cls, "value")

  def value(variable):
    owner = owners.get(id(variable))
    if owner is not None and not (recording.inside and recording.inside[-1] is owner):
      found.setdefault(id(owner), (owner, []))[1].append(variable.path)
    return prop.fget(variable)
  cls.value = property(value)
  try:
    yield found
  finally:
    if own is None:
      del cls.value
    else:
      cls.value = own


@contextlib.contextmanager
def trainable_reads():
  """Yields a function returning the ids of the trainable variables read in the block so far
  (None where TensorFlow's private watcher is unavailable: `unrecorded` then finds nothing)."""
  try:
    from tensorflow.python.eager import record as tf_record  # pylint: disable=g-import-not-at-top
    watcher = tf_record.VariableWatcher()
  except (ImportError, AttributeError):
    yield lambda: None
    return
  with watcher:
    yield lambda: {id(v) for v in watcher.watched_variables()}


def unrecorded(recorder, recording, read_ids) -> str:
  """Why a covered layer whose variables the forward read has no recorded call, or ''.

  A layer the loss does not use legitimately has none (its gradients are zero). A layer with a
  weight regulariser is skipped: Keras reads its weights for `model.losses` whether or not it
  was called.
  """
  if read_ids is None:
    return ""
  for layer, rule in recorder.layers:
    if any(recording.terms.get(i) for i in recorder.indices_of(layer, rule)) or (
        _regularised(layer)):
      continue
    if any(k in read_ids for v in layers.layer_variables(layer, rule) for k in _read_keys(v)):
      return (f"per_example: {type(layer).__name__} '{layer.name}' was used by the forward "
              "pass but its call was not recorded: the forward runs inside a tf.function traced "
              "before the recording (a decorated loss_fn or model call); remove that "
              "tf.function (trace the caller instead)")
  return ""


def _regularised(layer) -> bool:
  return any(name.endswith("_regularizer") and value is not None
             for name, value in vars(layer).items())


def _read_keys(variable):
  """The ids under which a read of `variable` is reported (per-replica components too)."""
  backend = general.unwrap(variable)
  return (id(variable), id(backend)) + tuple(id(c) for c in getattr(backend, "values", ()))
