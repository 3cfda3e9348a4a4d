"""A user's task that breaks the contract fails before training, in one line naming what is wrong.

Each case is a mistake found by a probe with tasks written as users write them (2026-12-03):
before these checks, a [B, 1] weight column trained silently unweighted, a subclassed model that
was not built yet failed deep inside Keras, tuple datasets and empty ones gave tracebacks, and
`mixed_precision` did not reach a task's own layers. In-process through `run.run`; the command
line turns these errors into one line with exit 2 (tests/test_tasks.py).
"""
import dataclasses
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import example_tasks
import helpers
from trainer import base_task
from trainer import errors
from trainer import loss_call
from trainer import run


def _config(**overrides):
  return helpers.tiny_config(**dict({"train_steps": 2, "steps_per_loop": 2, "mode": "train",
                                     "checkpoint_every": 2}, **overrides))


def _train(task_class, tmp_path, **overrides):
  config = _config(**overrides)
  return run.run(config, str(tmp_path), task=task_class(config))


def _xent(model, batch, training):
  return example_tasks._xent(model, batch, training)[0]  # pylint: disable=protected-access


class WeightColumn(example_tasks.NoMetrics):
  """Weights as a [B, 1] column (what `labels[:, None]`-style data gives)."""

  def per_example_loss(self, model, batch, training):
    weight = tf.cast(batch["y"], tf.float32)[:, None]
    return base_task.LossOutput(loss=_xent(model, batch, training), weight=weight)


class PerTokenLoss(example_tasks.NoMetrics):
  """Two values per example, e.g. a per-token loss flattened to [B * T]."""

  def per_example_loss(self, model, batch, training):
    return base_task.LossOutput(loss=tf.concat([_xent(model, batch, training)] * 2, 0))


class PerTokenMetric(example_tasks.NoMetrics):
  metric_names = ("error",)

  def per_example_loss(self, model, batch, training):
    loss = _xent(model, batch, training)
    return base_task.LossOutput(loss=loss, metrics={"error": tf.concat([loss, loss], 0)})


class _Subclassed(keras.Model):
  def __init__(self):
    super().__init__()
    self.hidden, self.out = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)

  def call(self, x):
    return self.out(self.hidden(x))


class NotBuilt(example_tasks.NoMetrics):
  def build_model(self):
    return _Subclassed()  # No variables until its first call.


class BuiltPrivateModel(example_tasks.NoMetrics):
  """A subclassed model of a class named `_Subclassed`: Keras names it `__subclassed`, which
  TensorFlow refuses as the root name scope of a traced call; `model.fit` trains it, and
  microstep failed in its first step (a probe, 2026-12-07)."""

  def build_model(self):
    model = _Subclassed()
    model(np.zeros([1, 12], np.float32))
    return model


@pytest.mark.parametrize("overrides", [
    {"mode": "train_and_eval"},
    {"accumulation.steps": 2, "per_example.every_steps": 1},
    {"strategy": "mirrored", "cpu_replicas": 2, "xla": "on"}], ids=["eval_export", "k2_stats",
                                                                   "mirrored_xla"])
def test_a_model_whose_name_starts_with_an_underscore_trains(tmp_path, overrides):
  config = _config(**dict({"eval_every": 2}, **overrides))
  assert BuiltPrivateModel(config).build_model().name.startswith("_")
  result = run.run(config, str(tmp_path), task=BuiltPrivateModel(config))
  assert result["global_step"] == 2
  if overrides.get("mode") != "train_and_eval":
    return  # Keras itself cannot export it: refused before training, not after it.
  config = _config(**{"eval_every": 2, "export_at_end": True})
  with pytest.raises(errors.TaskError, match=r"^the model's name '__subclassed(_\d+)?' starts "
                     r"with '_', which Keras cannot export .* or set `export_at_end`=False$"):
    run.run(config, str(tmp_path / "exporting"), task=BuiltPrivateModel(config))
  assert not (tmp_path / "exporting" / "checkpoints").exists()


class TrainingOnlyBranch(keras.Model):
  """A subclassed model whose `aux` layer runs only when training (built at its first call)."""

  def __init__(self):
    super().__init__()
    self.hidden, self.aux, self.out = (keras.layers.Dense(8, activation="tanh"),
                                       keras.layers.Dense(8, name="aux"), keras.layers.Dense(2))

  def call(self, x, training=None):
    h = self.hidden(x)
    return self.out(h + 0.5 * self.aux(x) if training else h)


class BuiltForInferenceOnly(example_tasks.NoMetrics):
  def build_model(self):
    model = TrainingOnlyBranch()
    model(np.zeros([1, 12], np.float32))  # Builds hidden and out; aux waits for training.
    return model


class NotAModel(example_tasks.NoMetrics):
  def build_model(self):
    return lambda x: x


class MetricNamedLoss(example_tasks.NoMetrics):
  metric_names = ("loss",)  # Would overwrite the reported loss.


class MetricNamesAString(example_tasks.NoMetrics):
  metric_names = ("error")  # A one-name tuple without its comma: the str 'error'.


class LayerMadeInTheLoss(example_tasks.NoMetrics):
  """Makes a Dense inside the loss: its variables are not the model's (TF then failed the
  trace with `tf.function only supports singleton tf.Variables created on the first call`)."""

  def per_example_loss(self, model, batch, training):
    logits = keras.layers.Dense(2)(model(batch["x"], training=training))
    return base_task.LossOutput(loss=keras.losses.sparse_categorical_crossentropy(
        batch["y"], logits, from_logits=True))


class StateMadeInTheLoss(example_tasks.NoMetrics):
  """Makes a non-trainable variable in every call of the loss (TF: `tf.function only supports
  singleton tf.Variables created on the first call`, a traceback)."""

  def per_example_loss(self, model, batch, training):
    counter = keras.Variable(0.0, trainable=False)
    return base_task.LossOutput(loss=_xent(model, batch, training) + 0.0 * counter)


class FieldTypo(example_tasks.NoMetrics):
  """Reads `label` where the data has `y`: a 60-line KeyError traceback until a probe."""

  def per_example_loss(self, model, batch, training):
    return base_task.LossOutput(loss=_xent(model, {"x": batch["x"], "y": batch["label"]},
                                           training))


class BatchedByTheSource(example_tasks.NoMetrics):
  """A tf.data source that batches its examples itself (e.g. a padded_batch): batched again, the
  model saw [16, 4, 12] and Keras' check was a traceback (a probe, 2026-12-07)."""

  def train_data(self):
    arrays = example_tasks._arrays(64, 1)  # pylint: disable=protected-access
    return lambda: tf.data.Dataset.from_tensor_slices(arrays).batch(4)


class NoTrainingArgument(example_tasks.NoMetrics):
  def per_example_loss(self, model, batch):  # pylint: disable=arguments-differ
    return base_task.LossOutput(loss=_xent(model, batch, False))


class TupleDataset(example_tasks.NoMetrics):
  """A tf.data factory of (x, y) tuples, as `from_tensor_slices((x, y))` makes them."""

  def train_data(self):
    arrays = example_tasks._arrays(64, 1)  # pylint: disable=protected-access
    return lambda: tf.data.Dataset.from_tensor_slices((arrays["x"], arrays["y"]))


class UnknownRankField(example_tasks.NoMetrics):
  """Labels from a tf.numpy_function without a shape: the loss reads them as they are (it
  failed inside the evaluation's padding, `TypeError: unsupported operand type(s) for -:
  'NoneType' and 'int'`). 40 evaluation examples: a short last batch to pad."""

  def _labelled(self, n, seed):
    arrays = example_tasks._arrays(n, seed)  # pylint: disable=protected-access

    def labelled():
      label = lambda i: tf.numpy_function(lambda j: arrays["y"][j], [i], tf.int64)
      return tf.data.Dataset.from_tensor_slices({"x": arrays["x"], "i": np.arange(n)}).map(
          lambda e: {"x": e["x"], "y": label(e["i"])})
    return labelled

  def train_data(self):
    return self._labelled(64, 1)

  def eval_data(self):
    return self._labelled(40, 2)


def test_a_tf_data_field_of_unknown_rank_trains_and_evaluates_with_a_warning(tmp_path, caplog):
  with caplog.at_level("WARNING"):
    result = _train(UnknownRankField, tmp_path, mode="train_and_eval", eval_every=2,
                    eval_batch_size=16)
  assert result["global_step"] == 2 and result["eval"]["examples"] == 40
  assert np.isfinite(result["eval"]["loss"])
  assert "the data function 'labelled' yields field(s) ['y'] of unknown rank" in caplog.text


class FeaturesOfUnknownWidth(example_tasks.NoMetrics):
  """The model meets x as [B, None] (a boolean mask, a summed VarLen field): its first kernel's
  gradient traces as [None, 16]. Under Mirrored with k = 1 the update's packed all-reduce
  unpacked by static shapes: `TypeError: unsupported operand type(s) for *: 'NoneType' and
  'int'`, a traceback (a probe, 2026-12-07)."""

  def per_example_loss(self, model, batch, training):
    x = tf.boolean_mask(batch["x"], tf.ones([12], tf.bool), axis=1)
    return base_task.LossOutput(loss=_xent(model, dict(batch, x=x), training))


def test_features_of_unknown_width_train_alike_on_one_and_two_replicas(tmp_path):
  checkpoint_weights = {}
  for name, overrides in (("default", {}), ("mirrored", {"strategy": "mirrored",
                                                         "cpu_replicas": 2})):
    result = _train(FeaturesOfUnknownWidth, tmp_path / name, **overrides)
    assert result["global_step"] == 2
    checkpoint_weights[name] = helpers.checkpoint_weights(tmp_path / name)[1]
  for key, value in checkpoint_weights["default"].items():
    np.testing.assert_allclose(checkpoint_weights["mirrored"][key], value, rtol=0, atol=1e-6)


class WeightFromTheModel(example_tasks.NoMetrics):
  """A weight computed from the model's own output (a confidence)."""

  def per_example_loss(self, model, batch, training):
    logits = model(batch["x"], training=training)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["y"], logits=logits)
    return base_task.LossOutput(loss=loss, weight=tf.sigmoid(logits[:, 0]) + 0.5)


@pytest.mark.parametrize("overrides", [{}, {"strategy": "mirrored", "cpu_replicas": 2,
                                            "batch_size": 8, "accumulation.steps": 2}],
                         ids=["default", "mirrored_k2"])
def test_a_weight_computed_from_the_model_is_data_no_gradient_flows_through_it(tmp_path,
                                                                              overrides):
  """The update took the gradient through the weights in Σ w·loss but not in the Σ w it
  divides by: 2.1 from Σ w·loss / Σ w either way (a probe, 2026-12-07). Weights are data, as
  Keras' sample weights are: one SGD update equals sum(stop_gradient(w) * loss) / sum(w)."""
  config = _config(**dict({"optimizer.name": "sgd", "optimizer.learning_rate": 0.5,
                           "train_steps": 1, "steps_per_loop": 1}, **overrides))
  task = WeightFromTheModel(config)
  strategy, trainer = helpers.build(config, tmp_path, task)
  initial, _ = helpers.snapshot(strategy, trainer)
  trainer.train(tf.constant(1))
  weights, _ = helpers.snapshot(strategy, trainer)
  batch, = helpers.update_batches(config, 1, task)
  model = task.build_model()
  for variable, value in zip(model.trainable_variables, initial):
    variable.assign(value)
  with tf.GradientTape() as tape:
    logits = model(batch["x"], training=True)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["y"], logits=logits)
    weight = tf.stop_gradient(tf.sigmoid(logits[:, 0]) + 0.5)
    mean = tf.reduce_sum(weight * loss) / tf.reduce_sum(weight)
  grads = tape.gradient(mean, model.trainable_variables)
  expected = [v.numpy() - 0.5 * g.numpy() for v, g in zip(model.trainable_variables, grads)]
  assert helpers.max_abs_diff(weights, initial) > 1e-3
  assert helpers.max_abs_diff(weights, expected) <= 1e-6


class AllWeightsMinusOne(example_tasks.NoMetrics):
  def per_example_loss(self, model, batch, training):
    loss = _xent(model, batch, training)
    return base_task.LossOutput(loss=loss, weight=-tf.ones_like(loss))


def test_negative_weights_train_and_log_as_given(tmp_path):
  """Every weight -1: the same update as +1 (Σ w·loss / Σ w), but the training log and
  TensorBoard showed loss NaN, as for a loop without examples; evaluation takes negative
  weights as given (a probe, 2026-12-07)."""
  outputs, weights = [], []
  for task_class in (example_tasks.NoMetrics, AllWeightsMinusOne):
    config = _config(**{"steps_per_loop": 1})
    strategy, trainer = helpers.build(config, tmp_path / task_class.__name__, task_class(config))
    outputs.append(float(trainer.train(tf.constant(1))["loss"]))
    weights.append(helpers.snapshot(strategy, trainer)[0])
  assert np.isfinite(outputs[0]) and outputs[1] == pytest.approx(outputs[0], rel=1e-6), outputs
  assert helpers.max_abs_diff(weights[0], weights[1]) <= 1e-6


class LabelsOfAnotherShape(example_tasks.NoMetrics):
  """One-hot labels of 3 classes against 2 logits: Keras' ValueError and a 40-line traceback,
  exit 1 (a probe, 2026-12-07)."""

  def per_example_loss(self, model, batch, training):
    logits = model(batch["x"], training=training)
    labels = tf.one_hot(batch["y"], 3)
    return base_task.LossOutput(loss=keras.losses.categorical_crossentropy(labels, logits))


class TypeErrorInTheLoss(example_tasks.NoMetrics):
  def per_example_loss(self, model, batch, training):
    logits = model(batch["x"], training=training)
    return base_task.LossOutput(loss=logits[:, 0] * sum(batch))  # Sums the field names.


class TypoInDataclassesReplace(example_tasks.NoMetrics):
  """The TypeError is raised in the standard library's dataclasses.py; the line named that file
  instead of this one (a probe, 2026-12-07)."""

  def per_example_loss(self, model, batch, training):
    out = base_task.LossOutput(loss=_xent(model, batch, training))
    return dataclasses.replace(out, weights=tf.ones_like(out.loss))


class FitStyleArrays(example_tasks.NoMetrics):
  def train_data(self):
    arrays = example_tasks._arrays(64, 1)  # pylint: disable=protected-access
    return arrays["x"], arrays["y"]


class EmptyDataset(example_tasks.NoMetrics):
  def train_data(self):
    arrays = example_tasks._arrays(64, 1)  # pylint: disable=protected-access
    return lambda: tf.data.Dataset.from_tensor_slices(arrays).filter(lambda e: e["y"] > 5)


class EmptyEvalDataset(example_tasks.NoMetrics):
  def eval_data(self):
    arrays = example_tasks._arrays(40, 2)  # pylint: disable=protected-access
    return lambda: tf.data.Dataset.from_tensor_slices(arrays).filter(lambda e: e["y"] > 5)


class RepeatingEvalDataset(example_tasks.NoMetrics):
  """Evaluation data that repeats: the evaluation never ended, and SIGTERM could not stop it."""

  def eval_data(self):
    arrays = example_tasks._arrays(40, 2)  # pylint: disable=protected-access
    return lambda: tf.data.Dataset.from_tensor_slices(arrays).repeat()


def test_evaluation_data_without_end_is_refused_at_start_unless_eval_steps_bound_it(tmp_path):
  with pytest.raises(errors.DataError, match=r"^eval_data\(\) \('<lambda>'\) repeats without end "
                     r"\(tf.data cardinality infinite\), so an evaluation would never finish; "
                     r"drop its .repeat\(\), or set `eval_steps`"):
    _train(RepeatingEvalDataset, tmp_path, mode="train_and_eval")
  assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())
  result = _train(RepeatingEvalDataset, tmp_path / "bounded", mode="train_and_eval", eval_steps=3)
  assert result["eval"]["examples"] == 3 * _config().eval_batch_size  # Three batches of it.
  assert _train(RepeatingEvalDataset, tmp_path / "train_only")["global_step"] == 2


class FewerExamplesThanABatch(example_tasks.NoMetrics):
  """10 examples in a tf.data source, batches of 16: each batch held examples twice, silently,
  where the same arrays are refused (a probe, 2026-12-07)."""

  def train_data(self):
    arrays = example_tasks._arrays(10, 1)  # pylint: disable=protected-access
    return lambda: tf.data.Dataset.from_tensor_slices(arrays)


class RepeatedFewExamples(FewerExamplesThanABatch):
  def train_data(self):
    return lambda: super(RepeatedFewExamples, self).train_data()().repeat()


def test_a_tf_data_source_smaller_than_a_batch_is_refused_as_arrays_are(tmp_path):
  with pytest.raises(errors.ConfigError, match=r"^`batch_size`=16 gives each replica 16 examples, "
                     r"more than the 10 of the tf.data training source; allowed: at most 10 "):
    _train(FewerExamplesThanABatch, tmp_path)
  with pytest.raises(errors.ConfigError, match=r"more examples than the 10 of the training data"):
    _train(TenArrays, tmp_path / "arrays")  # The same examples as arrays: refused before too.
  # Repeated by the user (its size unknown to TF's cardinality): trains, as before.
  assert _train(RepeatedFewExamples, tmp_path / "repeated")["global_step"] == 2
  # Evaluation data smaller than a batch is padded, as always.
  result = _train(SmallEvalDataset, tmp_path / "small_eval", mode="train_and_eval")
  assert result["eval"]["examples"] == 10


class SmallEvalDataset(example_tasks.NoMetrics):
  def train_data(self):
    return lambda: tf.data.Dataset.from_tensor_slices(example_tasks._arrays(64, 1))  # pylint: disable=protected-access

  def eval_data(self):
    return lambda: tf.data.Dataset.from_tensor_slices(example_tasks._arrays(10, 2))  # pylint: disable=protected-access


class TenArrays(example_tasks.NoMetrics):
  def train_data(self):
    return example_tasks._arrays(10, 1)  # pylint: disable=protected-access


class NegativeWeights(example_tasks.NoMetrics):
  def per_example_loss(self, model, batch, training):
    weight = tf.where(batch["y"] > 0, 1.0, -0.25)
    return base_task.LossOutput(loss=_xent(model, batch, training), weight=weight)


def test_evaluation_weighs_examples_as_training_does_negative_weights_too(tmp_path):
  """Evaluation dropped the losses of negative weights but kept the weights in the divisor."""
  config = _config()
  task = NegativeWeights(config)
  _, trainer, evaluator, _, eval_steps = run.build(config, str(tmp_path), task)
  result = evaluator.evaluate(tf.constant(eval_steps))
  out = task.per_example_loss(trainer.model, task.eval_data(), training=False)
  expected = float(tf.reduce_sum(out.loss * out.weight) / tf.reduce_sum(out.weight))
  assert result["loss"] == pytest.approx(expected, rel=1e-5)
  assert result["weight"] == pytest.approx(float(tf.reduce_sum(out.weight)))
  assert result["examples"] == 40.0  # Every row counts (negative weights too); not the weight sum.


def test_an_evaluation_that_counted_no_example_fails_in_one_line(tmp_path):
  """It reported loss 0.0 (a perfect model) over 0 examples."""
  with pytest.raises(errors.DataError, match="the evaluation data counted no example"):
    _train(EmptyEvalDataset, tmp_path, mode="train_and_eval")


class UnevenLengths(example_tasks.NoMetrics):
  """Examples of 12 features, and one of 11 (e.g. sequences a user forgot to pad)."""

  def train_data(self):
    def examples():
      for i in range(64):
        yield {"x": np.ones([11 if i == 5 else 12], np.float32), "y": np.int64(i % 2)}
    signature = {"x": tf.TensorSpec([None], tf.float32), "y": tf.TensorSpec([], tf.int64)}
    return lambda: tf.data.Dataset.from_generator(examples, output_signature=signature)


class GeneratorFunction(example_tasks.NoMetrics):
  """A Python generator function where a tf.data factory belongs (it returns a generator)."""

  def train_data(self):
    arrays = example_tasks._arrays(64, 1)  # pylint: disable=protected-access
    def examples():
      for i in range(64):
        yield {"x": arrays["x"][i], "y": arrays["y"][i]}
    return examples


class MixedDtypeRecords(example_tasks.NoMetrics):
  """Records whose target is an int in record 0 and a float in others: was cast to int64
  (2.5 -> 2), silently."""

  def build_model(self):
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(1)])

  def train_data(self):
    arrays = example_tasks._arrays(64, 1)  # pylint: disable=protected-access
    return [{"x": arrays["x"][i], "target": 3 if i == 0 else 0.5 * i} for i in range(64)]

  def eval_data(self):
    return None

  def per_example_loss(self, model, batch, training):
    error = model(batch["x"], training=training)[:, 0] - tf.cast(batch["target"], tf.float32)
    return base_task.LossOutput(loss=tf.square(error))


class WithStringLookup(example_tasks.NoMetrics):
  """Words through a StringLookup table, which XLA cannot compile (Keras: supports_jit=False)."""

  def build_model(self):
    words = keras.Input((), dtype="string")
    ids = keras.layers.StringLookup(vocabulary=["cat", "horse", "dog"])(words)
    return keras.Model(words, keras.layers.Dense(2)(keras.layers.Embedding(4, 3)(ids)))

  def train_data(self):
    names = np.array(["cat", "horse", "dog", "zebra"] * 16)
    return {"x": names, "y": (np.arange(64) % 2).astype(np.int64)}

  def eval_data(self):
    return None


@pytest.mark.parametrize("task_class,error,message", [
    (WeightColumn, errors.TaskError, r"weight has shape \(16, 1\); expected one weight per "),
    (PerTokenLoss, errors.TaskError, "loss has 32 values for a batch of 16 examples"),
    (PerTokenMetric, errors.TaskError, "metric 'error' has 32 values for a batch of 16"),
    (NotBuilt, errors.TaskError, "build_model returned a model with no variables yet"),
    (NotAModel, errors.TaskError, "build_model returned function; expected a keras.Model"),
    (BuiltForInferenceOnly, errors.TaskError, "BuiltForInferenceOnly.build_model: the model "
     r"created \S*aux/kernel, \S*aux/bias in its first training call; call it once with "
     "training=True"),
    (MetricNamedLoss, errors.TaskError,
     r"metric_names \['loss'\]: names must be distinct and not one of loss, weight, examples"),
    (MetricNamesAString, errors.TaskError, r"MetricNamesAString.metric_names is 'error'; "
     r"expected a tuple of str, e.g. \('accuracy',\) \(a one-name tuple needs its trailing"),
    (LayerMadeInTheLoss, errors.TaskError, r"^the task creates variables inside the training or "
     r"evaluation step, anew in every trace \(e.g. a Keras layer made inside per_example_loss"),
    (StateMadeInTheLoss, errors.TaskError, r"^the task creates variables inside the training or "
     r"evaluation step, anew in every trace "),
    (FieldTypo, errors.DataError, r"^FieldTypo.per_example_loss reads the field 'label', which "
     r"the training batch lacks; its fields: x, y$"),
    (BatchedByTheSource, errors.DataError, r"^the model rejects the batch's shape: Expected "
     r"shape \(None, 12\), but input has incompatible shape \(16, None, 12\) \(each field must have the shape of the model's input plus a "
     "leading batch axis; a tf.data source must yield single examples"),
    (NoTrainingArgument, errors.TaskError,
     r"per_example_loss cannot be called as \(model, batch, training=...\)"),
    (TupleDataset, errors.DataError, "tf.data source elements are tuple; expected dicts"),
    (FitStyleArrays, errors.DataError, r"train_data\(\) is a tuple of arrays, \(x, y\)"),
    (EmptyDataset, errors.DataError, "the training data yields no batch"),
    (UnevenLengths, errors.DataError,
     r"yields examples of different shapes \(component 0\. First element had shape \[1[12]\]"),
    (GeneratorFunction, errors.DataError, r"the data function 'examples' returned a generator; "
     r"it must return a tf.data.Dataset: wrap it, e.g. `lambda: tf.data.Dataset.from_generator"),
    (LabelsOfAnotherShape, errors.TaskError, r"^the task's per_example_loss fails "
     r"\(test_task_contract.py:\d+\): ValueError: Arguments `target` and `output` must have the "
     r"same shape. Received: target.shape=\(16, 3\), output.shape=\(16, 2\)$"),
    (TypeErrorInTheLoss, errors.TaskError, r"^the task's per_example_loss fails "
     r"\(test_task_contract.py:\d+\): TypeError: unsupported operand type"),
    (TypoInDataclassesReplace, errors.TaskError, r"^the task's per_example_loss fails "
     r"\(test_task_contract.py:\d+\): TypeError: .*unexpected keyword argument 'weights'"),
    (MixedDtypeRecords, errors.DataError, r"^train_data\(\)\[\d+\] field 'target' holds "
     r"float64 values where record 0 holds int64; give the field one dtype in every record"),
])
def test_contract_breaches_fail_in_one_line(tmp_path, task_class, error, message):
  with pytest.raises(error, match=message) as info:
    _train(task_class, tmp_path)
  assert "\n" not in str(info.value)


class RegressionOnLogits(example_tasks.NoMetrics):
  """A squared error of the model's output and a float32 target, as a regression writes it."""

  def per_example_loss(self, model, batch, training):
    first = model(batch["x"], training=training)[:, 0]
    return base_task.LossOutput(loss=tf.square(first - tf.cast(batch["y"], tf.float32)))


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_a_half_precision_output_met_by_float32_labels_is_one_line(tmp_path, precision):
  """The model's last Dense computes and returns bfloat16 under the policy; the loss's float32
  target met it in TF's TypeError and its stack (a probe, 2026-12-07)."""
  half = precision.split("_")[1]
  with pytest.raises(errors.TaskError, match=(
      rf"^Input 'y' of 'Sub' Op has type float32 that does not match type {half} "
      r"\(test_task_contract.py:\d+ in per_example_loss\): under a mixed precision policy Keras "
      rf"layers compute and return {half}; give the model's last layer dtype='float32'")):
    _train(RegressionOnLogits, tmp_path, mixed_precision=precision)
  assert _train(RegressionOnLogits, tmp_path / "f32")["global_step"] == 2


class NanInEvaluation(example_tasks.NoMetrics):
  """An evaluation loss that is NaN for some examples (as an overflow would make it)."""

  def per_example_loss(self, model, batch, training):
    loss = _xent(model, batch, training)
    if not training:
      loss += tf.where(batch["x"][:, 0] > 1.0, np.nan, 0.0)
    return base_task.LossOutput(loss=loss)


def test_a_nan_evaluation_is_a_warning_and_null_in_the_result(tmp_path, caplog):
  """It was written as null without a word (a probe, 2026-12-06)."""
  with caplog.at_level(logging.WARNING):
    result = _train(NanInEvaluation, tmp_path, mode="train_and_eval")
  assert result["eval"]["loss"] is None and result["eval"]["examples"] == 40
  assert "the evaluation is not finite (loss nan): the model's outputs" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    _train(example_tasks.NoMetrics, tmp_path / "finite", mode="train_and_eval")
  assert "not finite" not in caplog.text


def test_xla_on_refuses_a_layer_xla_cannot_compile_in_one_line(tmp_path):
  """It failed in the first step with a message about tracing (default_types.py)."""
  with pytest.raises(errors.ConfigError, match=r"^`xla`=on: layer 'string_lookup\S*' "
                     r"\(StringLookup\) cannot run under XLA \(Keras marks it supports_jit="
                     r"False\); allowed: auto \(then off for this model\) or off$"):
    _train(WithStringLookup, tmp_path, xla="on")
  assert _train(WithStringLookup, tmp_path / "auto", xla="auto")["global_step"] == 2


class HeadMadeOnceInTheLoss(example_tasks.NoMetrics):
  """Makes a Dense head at the first call of the loss and keeps it: it runs, but its weights are
  not the model's, so the optimizer never trains them (silent until 2026-12-07: a probe)."""

  def per_example_loss(self, model, batch, training):
    if not hasattr(self, "head"):
      self.head = keras.layers.Dense(2, kernel_initializer="ones", name="late_head")
    logits = self.head(model(batch["x"], training=training))
    return base_task.LossOutput(loss=keras.losses.sparse_categorical_crossentropy(
        batch["y"], logits, from_logits=True))


def test_a_layer_made_once_in_the_loss_trains_with_a_warning_that_it_never_learns(
    tmp_path, caplog):
  loss_call.WARNED_OUTSIDE.clear()
  task = HeadMadeOnceInTheLoss(_config())
  with caplog.at_level(logging.WARNING):
    assert run.run(_config(), str(tmp_path), task=task)["global_step"] == 2
  warnings = [r.getMessage() for r in caplog.records if "outside the model" in r.getMessage()]
  assert len(warnings) == 1, warnings  # Once, though the loss is traced several times.
  assert warnings[0].startswith("HeadMadeOnceInTheLoss.per_example_loss created 2 trainable "
                                "variable(s) outside the model (kernel, bias): the optimizer "
                                "never updates them"), warnings
  np.testing.assert_array_equal(task.head.kernel.numpy(), 1.0)  # As the warning says.
  caplog.clear()
  with caplog.at_level(logging.WARNING):  # A task whose layers are all the model's: silent.
    run.run(_config(), str(tmp_path / "plain"), task=example_tasks.NoMetrics(_config()))
  assert not [r for r in caplog.records if "outside the model" in r.getMessage()]


class UnknownRankOutputs(example_tasks.NoMetrics):
  """Loss, weight and metric of unknown rank (through tf.numpy_function): refused as "shape
  <unknown>; expected [B]" at trace time until a probe (2026-12-07)."""
  metric_names = ("error",)

  def per_example_loss(self, model, batch, training):
    loss = _xent(model, batch, training)
    return base_task.LossOutput(loss=_unknown_rank(loss), weight=_unknown_rank(tf.ones_like(loss)),
                                metrics={"error": _unknown_rank(loss)})


def _unknown_rank(t):
  """`t`'s values and gradient, its rank unknown to the trace (a copy through numpy)."""
  copy = tf.numpy_function(lambda a: a, [t], t.dtype, stateful=False)
  return copy + (t - tf.stop_gradient(t))


class UnknownRankPerToken(UnknownRankOutputs):
  def per_example_loss(self, model, batch, training):
    loss = _xent(model, batch, training)
    return base_task.LossOutput(loss=_unknown_rank(tf.stack([loss, loss], 1)),
                                metrics={"error": loss})


def test_outputs_of_unknown_rank_are_checked_when_the_step_runs(tmp_path):
  assert _train(UnknownRankOutputs, tmp_path)["global_step"] == 2
  with pytest.raises(errors.DataError, match=r"^UnknownRankPerToken.per_example_loss: loss is not "
                                             r"one value per example \[B\]\.?$"):
    _train(UnknownRankPerToken, tmp_path / "per_token")


class ScalarWeight(example_tasks.NoMetrics):
  def per_example_loss(self, model, batch, training):
    return base_task.LossOutput(loss=_xent(model, batch, training), weight=2.0)


def test_one_weight_for_the_whole_batch_is_broadcast(tmp_path):
  assert _train(ScalarWeight, tmp_path)["global_step"] == 2


class MixedPrecision(example_tasks.NoMetrics):
  """Layers without a dtype (they follow the config's policy); float32 logits, as Keras'
  mixed-precision guide advises."""

  def build_model(self):
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(2, dtype="float32")])


@pytest.mark.parametrize("policy,compute", [("mixed_float16", "float16"),
                                            ("mixed_bfloat16", "bfloat16")])
def test_mixed_precision_reaches_the_layers_of_a_users_task(tmp_path, policy, compute):
  config = _config(mixed_precision=policy)
  _, trainer = helpers.build(config, tmp_path, MixedPrecision(config))
  hidden, logits = trainer.model.layers
  assert (hidden.compute_dtype, hidden.variable_dtype) == (compute, "float32")
  assert logits.compute_dtype == "float32"
  assert keras.config.dtype_policy().name == "float32"  # Restored after the model was built.
  config = _config(mixed_precision=policy, mode="train_and_eval")
  result = run.run(config, str(tmp_path / "run"), task=MixedPrecision(config))
  assert result["global_step"] == 2 and np.isfinite(result["eval"]["loss"])


class ZeroWeights(example_tasks.NoMetrics):
  def per_example_loss(self, model, batch, training):
    return base_task.LossOutput(loss=_xent(model, batch, training),
                                weight=tf.zeros_like(batch["y"], tf.float32))


def test_updates_whose_weights_sum_to_zero_stop_with_that_cause_named(tmp_path):
  """0/0 is skipped like a divergence; the error named only non-finite loss or gradients."""
  with pytest.raises(FloatingPointError, match="an update whose weights sum to 0"):
    _train(ZeroWeights, tmp_path, train_steps=4, max_consecutive_skips=2)


class Counter(keras.layers.Layer):
  """Counts its training calls in a float non-trainable variable (state written in the forward)."""

  def build(self, input_shape):
    self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

  def call(self, x, training=None):
    if training:
      self.calls.assign_add(1.0)
    return x


class CountingModel(example_tasks.NoMetrics):
  def build_model(self):
    return keras.Sequential([keras.Input((12,)), Counter(), keras.layers.Dense(2)])


def test_state_written_k_times_per_update_is_named_in_a_warning(tmp_path, caplog):
  """A counter or a running mean moves once per micro-step: k times per update, not once."""
  result = _train(CountingModel, tmp_path, **{"accumulation.steps": 2, "batch_size": 8})
  assert result["global_step"] == 2
  warned = [r.getMessage() for r in caplog.records if "once per micro-step" in r.getMessage()]
  assert len(warned) == 1 and "counter/calls" in warned[0] and "2 times per update" in warned[0]


class BuiltBeforeTheRun(example_tasks.NoMetrics):
  """The model is made in the constructor, outside the strategy's scope; build_model returns it.
  Under Mirrored this failed in the first step inside Keras (colocate_vars_with)."""

  def __init__(self, config):
    super().__init__(config)
    self._model = example_tasks._mlp()  # pylint: disable=protected-access

  def build_model(self):
    return self._model


def test_a_model_built_before_the_run_is_one_line_under_mirrored(tmp_path):
  with pytest.raises(errors.TaskError, match=r"^BuiltBeforeTheRun.build_model: variable \S+ was "
                     "created outside the MirroredStrategy scope; create the model inside "
                     "build_model") as info:
    _train(BuiltBeforeTheRun, tmp_path, strategy="mirrored", cpu_replicas=2)
  assert "\n" not in str(info.value)


class Float16Policy(example_tasks.NoMetrics):
  """Sets Keras' global policy itself: without `mixed_precision`=mixed_float16 no loss scaling
  runs and the gradients were silently zero."""

  def build_model(self):
    keras.config.set_dtype_policy("mixed_float16")
    return example_tasks._mlp()  # pylint: disable=protected-access


def test_a_float16_policy_set_in_build_model_needs_mixed_float16(tmp_path):
  with pytest.raises(errors.ConfigError, match=r"^`mixed_precision`='float32' but layer '\S+' of "
                     r"Float16Policy.build_model computes in float16 .*allowed: mixed_float16"):
    _train(Float16Policy, tmp_path)
  assert keras.config.dtype_policy().name == "float32"  # The run restored the global policy.
  assert _train(Float16Policy, tmp_path / "ok", mixed_precision="mixed_float16")[
      "global_step"] == 2


class TextAsObjects(WithStringLookup):
  """Words in an object array, as a pandas text column gives them."""

  def train_data(self):
    return dict(super().train_data(), x=np.array(["cat", "horse", "dog", "zebra"] * 16, object))


class MixedObjects(WithStringLookup):
  def train_data(self):
    return dict(super().train_data(), x=np.array(["cat", 3] * 32, object))


def test_text_in_an_object_array_trains_as_text(tmp_path):
  """It was refused as 'dtype object; expected numbers', though string fields are supported."""
  assert _train(TextAsObjects, tmp_path)["global_step"] == 2
  with pytest.raises(errors.DataError, match=r"^train_data\(\) field 'x' has dtype object "
                     r"holding int, str; allowed: numbers, or text of one kind"):
    _train(MixedObjects, tmp_path / "mixed")
