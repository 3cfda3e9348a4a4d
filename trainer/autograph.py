"""Which code AutoGraph converts: the task's, not microstep's.

AutoGraph rewrites a traced function's Python `if`/`for`/`while` on tensors into TensorFlow
control flow, by parsing and recompiling the function's source (~0.05-0.3 s per function on a
2-core machine) in every process. microstep's ~40 functions of the training and evaluation
steps cost 2-3 s of each run's start, a fifth of a smoke run (docs/benchmarks.md). microstep's
own code has no Python control flow on tensors (its loops are explicit `tf.while_loop`s), so
it is traced as written:

  * `library` marks the framework's traced entry points (Orbit's `train_step` and
    `eval_step`, tf.data functions). Everything they call runs unconverted, and
    `strategy.run` does not convert the replica functions they hand it.
  * `task_code(fn)` is how the framework calls a task's method (`per_example_loss`,
    `represent`, `batch_loss`, an ExampleSource's `take`): converted, and what it calls
    recursively, as inside a plain `tf.function`. A task may write `if tf.reduce_sum(x) > 0:`.
  * `next_batch(iterator)` reads a batch inside `library` code.
  * `like_caller(fn)`: the per-example library's user callables (`loss_fn`), converted exactly
    when their caller runs with AutoGraph on, as `tf.function` would have done. That library is
    `library` code too (converting it cost time and a few MiB per process).

Called at trace time (graph building), in any context; eagerly, converted code runs as Python.
"""
# AutoGraph's own entry points: TensorFlow has no public call that converts a function from
# inside code AutoGraph leaves alone.
# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.core import converter
from tensorflow.python.autograph.impl import api
import tensorflow as tf

library = tf.autograph.experimental.do_not_convert

# What a function called from `tf.function` code is converted with (its "call options").
_AS_TF_FUNCTION_CALLEES = converter.ConversionOptions(recursive=True, optional_features=None)


def task_code(fn):
  """`fn` converted by AutoGraph, with its callees; as-is where AutoGraph cannot convert it.

  Under `library` code AutoGraph is off, so the conversion is asked for explicitly, with the
  options `tf.function` gives the functions it calls. An error raised inside comes out as it
  was raised (a KeyError stays a KeyError of the missing field): `tf.function` rewrites it at
  its own boundary, as before. microstep's own code (module `trainer.*`) is returned as it is,
  except its built-in tasks: a user's subclass may override a helper their methods call.
  """
  module = getattr(fn, "__module__", None) or ""
  if module.startswith("trainer.") and not module.startswith("trainer.tasks."):
    return fn

  def converted(*args, **kwargs):
    with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED):
      return api.converted_call(fn, args, kwargs, options=_AS_TF_FUNCTION_CALLEES)
  return converted


def next_batch(iterator):
  """`next(iterator)` in `library` code (traced, cross-replica context).

  TensorFlow counts the graph-mode `get_next` calls traced with AutoGraph off and refuses the
  33rd, taking them for a Python `for` loop over a dataset. gradcache reads the update's k
  micro-batches on purpose (the triplet recipe: k = 128), so the read is traced with
  AutoGraph's status unspecified, as in a plain `tf.function`, where nothing is counted.
  """
  with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.UNSPECIFIED):
    return next(iterator)


def like_caller(fn):
  """`fn` converted by AutoGraph iff the calling context has AutoGraph on (tf.function's
  default); traced or eager, any context."""
  return tf.__internal__.autograph.tf_convert(
      fn, tf.__internal__.autograph.control_status_ctx(), convert_by_default=False)
