"""The Task: what a user writes to train their own model on their own data with microstep.

A task is a class with four methods and one attribute. microstep owns everything else: the
strategy, the data order, accumulation, the update, checkpoints, evaluation, export.

    class MyTask(base_task.Task):
      metric_names = ("accuracy",)          # per-example metrics; () is fine

      def build_model(self):                # eager, under strategy.scope()
        return keras.Sequential([...])

      def train_data(self):                 # eager, host, once per run
        return {"x": x_train, "y": y_train} # or an .npz path, an indexable, a tf.data factory

      def eval_data(self):                  # None: no evaluation
        return {"x": x_test, "y": y_test}

      def per_example_loss(self, model, batch, training):   # traced, replica context
        logits = model(batch["x"], training=training)
        loss = keras.losses.sparse_categorical_crossentropy(batch["y"], logits, from_logits=True)
        correct = tf.cast(tf.argmax(logits, -1) == batch["y"], tf.float32)
        return base_task.LossOutput(loss=loss, metrics={"accuracy": correct})

Select it with `--config.task=my_module:MyTask` (an import path; the built-in short names
`classification`, `triplet`, `text_classification`, `npz_classification` still work), or pass
an instance to `trainer.train(config, workdir, task=MyTask(config))`. docs/tasks.md has a worked
example that runs as written.

**The loss contract.** `per_example_loss` returns one loss per example, never a mean: microstep
sums `loss * weight` over every micro-step and replica of an update and divides by the sum of
weights, so an update on k micro-batches equals one step on the concatenated batch, whatever the
masks. `weight` (default: ones) lets an example count for less or not at all. `metrics` are
per-example values, averaged with the same weights. The batch never contains padding you have to
handle: microstep pads the last evaluation batch itself and gives padded rows weight 0.

**Data.** `train_data()` and `eval_data()` return one of:

  * random access (the default path): a dict of numpy arrays with one leading dimension; a path
    to an `.npz` file of one split (its arrays by name; a file of several splits, `x_train` and
    `x_test`, is refused in one line: return a dict of one split's arrays, or use the
    `npz_classification` task); any object with `__len__` and `__getitem__(i) -> dict of arrays` (e.g.
    `tfds.data_source(...)`, ArrayRecord readers); or an `ExampleSource`. microstep draws
    examples through a deterministic, resumable stream: example order does not depend on the
    number of replicas or workers, k micro-batches are exactly one batch of k·B, and a restart
    resumes from one integer in the checkpoint.
  * a `tf.data` factory: a callable `f()` or `f(input_context)` returning a `tf.data.Dataset` of
    single examples (dicts of tensors), e.g. TFRecord files or `tfds.load`. microstep shards it
    (when `f` takes no argument), repeats and batches it for training, and stores the iterator
    with each checkpoint where TensorFlow can save it (`config.data.resume`; not with a
    py_function, from_generator or unseeded random ops: then a restart skips what was
    consumed); see docs/tasks.md for the rules per strategy.

Errors in your data are yours to describe: raise `DataError` with one line naming what is wrong,
and microstep prints that line and exits with code 2.

**Losses over the whole batch** (contrastive losses with in-batch negatives, batch-hard triplet
mining, a loss on a histogram of the outputs) do not decompose over examples, so averaging
micro-batch gradients is not their big-batch gradient. Subclass `BatchLossTask` instead: it
declares `represent(model, batch, training)` (per-example representations) and
`batch_loss(representations, valid)` (one scalar over ALL representations of the update), and
`config.accumulation.mode = "gradcache"` makes the update exact (`trainer.gradcache`,
docs/accumulation.md).
"""
import dataclasses
import inspect
from typing import Any, Callable, Optional, Sequence

import keras
import tensorflow as tf

from trainer import autograph
from trainer import errors
from trainer import loss_call

DataError = errors.DataError


@dataclasses.dataclass(frozen=True)
class LossOutput:
  """What `Task.per_example_loss` returns for a batch of B examples.

  Attributes:
    loss: [B] per-example losses (any float dtype; summed in float32).
    weight: [B] per-example weights, or None for ones. 0 drops an example from the sums (its
      loss must still be finite in training: 0 x NaN is NaN). Weights are data: no gradient
      flows through them, even when computed from the model (put a learned weighting in the
      loss instead).
    metrics: name -> [B] per-example values, one entry per name in `Task.metric_names`.
  """
  loss: Any
  weight: Any = None
  metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ExampleSource:
  """A random-access source in TensorFlow terms, for sources that draw per-position randomness.

  Attributes:
    num_examples: N; the stream visits examples 0..N-1 once per epoch.
    take: `take(ids, positions) -> dict of tensors` with leading dimension b. Traced inside
      tf.data on the host. `ids` [b] int64 are the examples to return; `positions` [b] int64
      their places in the infinite stream (unique; position p belongs to epoch p // N), for
      sources that draw extra randomness per example, e.g. a triplet's positive and negative.
  """
  num_examples: int
  take: Callable[[tf.Tensor, tf.Tensor], dict]


class Task:
  """Base class of a task; subclass it and override the methods below (see the module docstring).

  Attributes:
    config: the run's `ml_collections.ConfigDict`; add your own fields to it in your config file.
    metric_names: names of the per-example metrics `per_example_loss` returns (may be empty).
  """
  metric_names: Sequence[str] = ()

  def __init__(self, config):
    """Eager, host. Check your config fields here and raise `errors.ConfigError` with one line."""
    self.config = config

  def build_model(self):
    """Returns a new Keras model with its variables; called eagerly inside `strategy.scope()`,
    with Keras' global dtype policy set to `config.mixed_precision`."""
    raise NotImplementedError(f"{type(self).__name__}.build_model")

  def train_data(self):
    """Returns the training source (see the module docstring); eager, host, once per run."""
    raise NotImplementedError(f"{type(self).__name__}.train_data")

  def eval_data(self):
    """Returns the evaluation source, or None for no evaluation; eager, host."""
    return None

  def per_example_loss(self, model, batch: dict, training: bool) -> LossOutput:
    """Per-example losses, weights and metrics of `batch`; traced, in replica context."""
    raise NotImplementedError(f"{type(self).__name__}.per_example_loss")

  def serving_signature(self) -> Optional[list]:
    """Input `tf.TensorSpec`s of the exported model (eager, host, at export). None: the model's
    own `inputs`; for a subclassed model, the inputs the loss gives it on a batch of the data
    (docs/tasks.md, "Export")."""
    return None


@dataclasses.dataclass(frozen=True)
class BatchLossOutput:
  """What `BatchLossTask.batch_loss` returns: one scalar loss, and scalar metrics by name."""
  loss: Any
  metrics: dict = dataclasses.field(default_factory=dict)


class BatchLossTask(Task):
  """A task whose loss is defined on a whole batch of representations (see the module docstring).

  With `accumulation.mode = "gradcache"` the update's loss is `batch_loss` of the
  representations of EVERY example of the update (all micro-batches, all replicas, in stream
  order), and its gradient is exact at micro-batch memory. With the plain `sum` mode each
  replica's micro-batch gets its own `batch_loss` (`per_example_loss` below): the averaging that
  is NOT the big batch's gradient, kept for comparison. Evaluation takes `batch_loss` of each
  global evaluation batch, gathered from every replica.
  """

  def represent(self, model, batch: dict, training: bool) -> dict:
    """Per-example representations: a dict of [b, ...] tensors; traced, replica context.

    Float fields carry gradients (e.g. embeddings); others (e.g. labels) only ride along.
    """
    raise NotImplementedError(f"{type(self).__name__}.represent")

  def batch_loss(self, representations: dict, valid) -> BatchLossOutput:
    """One scalar loss over [N, ...] representations; `valid` [N] is 0 for padding rows."""
    raise NotImplementedError(f"{type(self).__name__}.batch_loss")

  def per_example_loss(self, model, batch, training):
    raise errors.TaskError(f"{type(self).__name__} is a BatchLossTask: microstep computes its "
                           "loss per batch (weighted_outputs)")


# ---------------------------------------------------------------------------------------------
# The framework's side of the contract: microstep calls these, tasks do not.
def batch_loss_of(task, representations, valid) -> BatchLossOutput:
  """`task.batch_loss`, checked against the contract (traced, any context)."""
  out = autograph.task_code(task.batch_loss)(representations, valid)
  name = type(task).__name__
  if not isinstance(out, BatchLossOutput):
    raise errors.TaskError(f"{name}.batch_loss returned {type(out).__name__}; expected "
                           "base_task.BatchLossOutput(loss=..., metrics=...)")
  if tf.convert_to_tensor(out.loss).shape.rank != 0:
    raise errors.TaskError(f"{name}.batch_loss: loss has shape "
                           f"{tf.convert_to_tensor(out.loss).shape}; expected a scalar")
  if set(out.metrics) != set(task.metric_names):
    raise errors.TaskError(f"{name}.batch_loss: metrics {sorted(out.metrics)} differ from "
                           f"{name}.metric_names {sorted(task.metric_names)}")
  return out


_GATHERED_VALID = "__microstep_valid__"  # The validity mask, gathered beside the representations.


def weighted_outputs(task, model, batch: dict, training: bool, gather=None):
  """Runs `task.per_example_loss` on a batch from `trainer.data`; traced, replica context.

  Removes the framework's validity mask (`trainer.sources.VALID_KEY`) from the batch, multiplies it
  into the task's weights, and checks the task's output against the contract. A BatchLossTask's
  `batch_loss` takes this replica's representations, or with `gather` (a function of a dict of
  [b, ...] fields, e.g. an all_gather over the replicas) what it returns; every row of this
  replica then gets that loss.

  Returns:
    (loss [B] float32, weight [B] float32, [metric [B] float32 per name in task.metric_names]).
  """
  from trainer import sources  # pylint: disable=g-import-not-at-top
  features = {k: v for k, v in batch.items() if k != sources.VALID_KEY}
  valid = batch[sources.VALID_KEY]
  if isinstance(task, BatchLossTask):  # Its own batch's loss, for every example of the batch.
    with loss_call.fields_named(task, "represent", features, training):
      represented = loss_call.variables_outside_noted(
          task, model, "represent",
          lambda: autograph.task_code(task.represent)(model, features, training=training))
    if gather is None:
      out = batch_loss_of(task, represented, valid)
    else:
      everything = gather(dict(represented, **{_GATHERED_VALID: valid}))
      out = batch_loss_of(task, everything, everything.pop(_GATHERED_VALID))
    fill = lambda value: tf.fill(tf.shape(valid), tf.cast(value, tf.float32))
    return fill(out.loss), valid, [fill(out.metrics[m]) for m in task.metric_names]
  with loss_call.fields_named(task, "per_example_loss", features, training):
    out = loss_call.variables_outside_noted(
        task, model, "per_example_loss",
        lambda: autograph.task_code(task.per_example_loss)(model, features, training=training))
  name = type(task).__name__
  if not isinstance(out, LossOutput):
    raise errors.TaskError(f"{name}.per_example_loss returned {type(out).__name__}; expected "
                           "base_task.LossOutput(loss=..., weight=..., metrics=...)")
  loss = _rank_one_if_unknown(f"{name}.per_example_loss: loss", tf.cast(out.loss, tf.float32))
  if loss.shape.rank != 1:
    raise errors.TaskError(f"{name}.per_example_loss: loss has shape {loss.shape}; expected one "
                           "value per example [B] (never a mean)")
  loss = _check_per_example(f"{name}.per_example_loss: loss", loss, valid)
  weight = valid
  if out.weight is not None:
    weight = _rank_one_if_unknown(f"{name}.per_example_loss: weight",
                                  tf.cast(out.weight, tf.float32))
    if weight.shape.rank == 0:  # One weight for the whole batch.
      weight = tf.fill(tf.shape(valid), weight)
    if weight.shape.rank != 1:  # A [B, 1] column would broadcast with the loss to [B, B].
      raise errors.TaskError(f"{name}.per_example_loss: weight has shape {weight.shape}; "
                             "expected one weight per example [B] (flatten a [B, 1] column)")
    weight = _check_per_example(f"{name}.per_example_loss: weight", weight, valid)
    # Weights are data, as Keras' sample weights are: no gradient flows through them. (One
    # computed from the model got it in Σ w·loss but not in the Σ w the update divides by.)
    weight = tf.stop_gradient(weight * valid)
  if set(out.metrics) != set(task.metric_names):
    raise errors.TaskError(f"{name}.per_example_loss: metrics {sorted(out.metrics)} differ from "
                           f"{name}.metric_names {sorted(task.metric_names)}")
  metrics = []
  for m in task.metric_names:
    value = _rank_one_if_unknown(f"{name}.per_example_loss: metric {m!r}",
                                 tf.cast(out.metrics[m], tf.float32))
    if value.shape.rank != 1:
      raise errors.TaskError(f"{name}.per_example_loss: metric {m!r} has shape {value.shape}; "
                             "expected [B]")
    metrics.append(_check_per_example(f"{name}.per_example_loss: metric {m!r}", value, valid))
  return loss, weight, metrics


def _rank_one_if_unknown(what: str, value):
  """`value` as a vector when the trace does not know its rank (after a `tf.numpy_function`, or
  a comparison with a field of unknown shape): checked when the step runs, failing it with one
  line, instead of refused at trace time as not [B] (a probe, 2026-12-07)."""
  if value.shape.rank is not None:
    return value
  check = tf.debugging.assert_rank(value, 1, message=f"{what} is not one value per example [B]")
  with tf.control_dependencies([check]):
    return tf.reshape(value, [-1])  # (Only after the check: rank 1, or the step fails.)


def _check_per_example(what: str, value, valid):
  """`value`, checked to hold one entry per example (traced): a static length that differs
  from the batch's raises TaskError; an unknown one (e.g. after `tf.boolean_mask`) gets an
  assertion that fails the step with the same sentence."""
  length, batch = value.shape[0], valid.shape[0]
  if length is not None and batch is not None:
    if length != batch:
      raise errors.TaskError(f"{what} has {length} values for a batch of {batch} examples; "
                             "expected one per example [B] (e.g. not one per token)")
    return value
  check = tf.debugging.assert_equal(
      tf.shape(value)[0], tf.shape(valid)[0],
      message=f"{what} has another number of values than the batch has examples; expected "
      "one per example [B] (give the examples to leave out weight 0, not a tf.boolean_mask)")
  with tf.control_dependencies([check]):
    return tf.identity(value)


def check_no_new_variables(task, model, known_ids) -> None:
  """Trace time, after a training forward: the model created no trainable variable (one the
  optimizer, the accumulation buffers and the checkpoint would not know). Raises TaskError.

  A subclassed model builds a layer at its first call, so a layer used only when `training` is
  true gets its variables in the first training step unless `build_model` calls it that way.
  """
  created = [getattr(v, "path", v.name) for v in model.trainable_variables
             if id(v) not in known_ids]
  if created:
    raise errors.TaskError(
        f"{type(task).__name__}.build_model: the model created {', '.join(created)} in its "
        "first training call; call it once with training=True inside build_model (layers of a "
        "subclassed model are built at their first call)")


# Names microstep reports beside a task's metrics (training logs, evaluation results).
RESERVED_METRIC_NAMES = ("loss", "weight", "examples")


def _sequence_of_str(names) -> bool:
  if isinstance(names, (str, bytes)):
    return False
  try:
    return all(isinstance(n, str) for n in names)
  except TypeError:  # Not iterable.
    return False


def check_contract(task, model) -> None:
  """Eager, host, once per run: what can be checked of a task before any step runs.

  Raises TaskError (one line) when `metric_names` is not a sequence of str (e.g. a bare
  string: a one-name tuple without its comma), when `build_model()` did not return a Keras
  model, returned one with no variables yet (a subclassed Model gets them at its first call),
  when a metric name is one microstep reports itself, or when `per_example_loss` cannot be
  called as (model, batch, training=...).
  """
  name = type(task).__name__
  names = task.metric_names
  if not _sequence_of_str(names):
    raise errors.TaskError(
        f"{name}.metric_names is {names!r}; expected a tuple of str, e.g. ('accuracy',) "
        "(a one-name tuple needs its trailing comma)")
  taken = sorted(set(names) & set(RESERVED_METRIC_NAMES))
  if taken or len(set(names)) != len(names):
    raise errors.TaskError(
        f"{name}.metric_names {list(names)}: names must be distinct and not one of "
        f"{', '.join(RESERVED_METRIC_NAMES)} (microstep reports those itself)")
  if not isinstance(model, keras.Model):
    raise errors.TaskError(f"{name}.build_model returned {type(model).__name__}; expected a "
                           "keras.Model")
  if not model.variables:
    raise errors.TaskError(
        f"{name}.build_model returned a model with no variables yet (a subclassed keras.Model "
        "creates them at its first call): call it once on an example batch inside build_model, "
        "or build it with keras.Input")
  method_name = "represent" if isinstance(task, BatchLossTask) else "per_example_loss"
  try:
    signature = inspect.signature(getattr(task, method_name))
  except (TypeError, ValueError):  # A callable without a signature: nothing to check.
    return
  try:
    signature.bind(model, {}, training=False)
  except TypeError as e:
    raise errors.TaskError(f"{name}.{method_name} cannot be called as (model, batch, "
                           f"training=...): {e}") from None


def check_model_fits_run(task, model, strategy, mixed_precision: str) -> None:
  """Eager, host, once per run, after `check_contract`: the model was built for this run.

  Raises TaskError when its variables were created outside `strategy.scope()` (a model built
  before the run, e.g. in the task's constructor: Mirrored then fails deep inside Keras), and
  ConfigError when layers compute in float16 but `mixed_precision` is not mixed_float16 (a
  policy set inside build_model: without loss scaling small gradients flush to zero).
  """
  name = type(task).__name__
  outside = [v for v in model.variables
             if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))]
  if outside:
    raise errors.TaskError(
        f"{name}.build_model: variable {getattr(outside[0], 'path', outside[0].name)} was "
        f"created outside the {type(strategy).__name__} scope; create the model inside "
        "build_model (microstep calls it under strategy.scope()), not before the run")
  if mixed_precision == "mixed_float16":
    return
  float16 = [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
             if getattr(layer, "compute_dtype", None) == "float16"]
  if float16:
    raise errors.ConfigError(
        f"`mixed_precision`={mixed_precision!r} but layer {float16[0].name!r} of "
        f"{name}.build_model computes in float16 (a dtype policy set in the task?); allowed: "
        "mixed_float16 (with loss scaling), or layers in float32/bfloat16")
