"""A task's loss method, called while the step is traced (replica context), watched for two
mistakes that TensorFlow reports badly or not at all: a field the batch lacks (a 60-line
KeyError traceback) and trainable variables made outside the model (silently never trained).
Used by `trainer.base_task.weighted_outputs`; Python only, creates no ops (the call runs in a
name scope named after the method).
"""
import contextlib

from absl import logging
import tensorflow as tf

from trainer import errors


@contextlib.contextmanager
def fields_named(task, method: str, features: dict, training: bool):
  """A KeyError of a field the batch lacks (a typo, a field only the evaluation data has), raised
  by the task's loss while the step is traced, becomes one line naming the batch's fields (it
  was a 60-line traceback; found by a probe)."""
  try:
    yield
  except KeyError as e:
    field = e.args[0] if len(e.args) == 1 else None
    if not training or not isinstance(field, str) or field in features:
      raise  # (Evaluation data lacking a field: `run._check_eval_fields` names it, at start.)
    raise errors.DataError(
        f"{type(task).__name__}.{method} reads the field {field!r}, which the training batch "
        f"lacks; its fields: {', '.join(sorted(features))}") from None


def in_a_name_scope(method: str):
  """A name scope for a task's traced call: a model of a class whose name starts with `_` (Keras
  names it `__my_net`) cannot open the ROOT name scope of a traced graph ("not a valid root
  scope name"), inside one it can, as under `model.fit` (a probe, 2026-12-07)."""
  return tf.name_scope(method)


WARNED_OUTSIDE = set()  # (task class, method) whose variables outside the model were logged.


def variables_outside_noted(task, model, method: str, call):
  """`call()`, a task's loss method (traced), with one WARNING per task class and method when
  it created trainable variables that are not the model's: a Keras layer made (once) inside the
  loss. The optimizer updates only the model's variables, so such a layer never learns; that is
  right for a frozen teacher and silently wrong for anything meant to train. (A layer made anew
  in every trace fails the step instead: `trainer.step_errors`.) A subclassed model's own layers
  built at their first call become the model's variables and are not counted; non-trainable
  state made on the way (a seed generator) is not counted either.
  """
  created = []

  def note(next_creator, **kwargs):
    if kwargs.get("trainable", True) is not False:
      created.append(str(kwargs.get("name") or "unnamed"))
    return next_creator(**kwargs)
  before = len(model.trainable_variables)
  with tf.variable_creator_scope(note), in_a_name_scope(method):
    out = call()
  outside = len(created) - (len(model.trainable_variables) - before)
  key = (type(task), method)
  if outside > 0 and key not in WARNED_OUTSIDE:
    WARNED_OUTSIDE.add(key)
    logging.warning(
        "%s.%s created %d trainable variable(s) outside the model (%s): the optimizer never "
        "updates them. Make a layer that should learn in build_model; a frozen one: set its "
        "trainable=False", type(task).__name__, method, outside,
        ", ".join(created[:4]) + (", ..." if len(created) > 4 else ""))
  return out
