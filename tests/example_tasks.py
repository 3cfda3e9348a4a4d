"""Tasks written the way a user writes them, for the tests (imported by path, e.g. from the CLI).

`Streamed` reads through a tf.data factory (the streaming path): generated features, shuffled with
a fixed seed, mapped; it resumes by restoring the input iterator. `NoMetrics` has no metrics and
dict-of-arrays data. `BadLoss` returns a [B, 1] loss, `BadData` raises DataError;
`LabelsOutOfRange` and `IdsOutOfVocabulary` hold values their model's kernels reject;
`MaskedLoss` returns fewer losses than examples.
`GradientPenalty` differentiates the model inside its loss; `PositionTransformer` adds a
position Embedding that does not depend on the batch. `HardExampleWeights` (a loss) and
`CenteredBatch` (a model) mix the examples; `ActivityRegularised` penalises its logits.
`UnusedHead` has a second output head its
loss leaves out; `ConstantLoss` never uses the model.
"""
import time

import keras
import numpy as np
import tensorflow as tf

from trainer import base_task


def _arrays(n, seed):
  rng = np.random.RandomState(seed)
  x = rng.normal(size=(n, 12)).astype(np.float32)
  y = (x[:, :3].sum(1) > 0).astype(np.int64)
  return {"x": x, "y": y}


def _mlp():
  return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                           keras.layers.Dense(2)])


def _xent(model, batch, training):
  logits = model(batch["x"], training=training)
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["y"], logits=logits), logits


class Streamed(base_task.Task):
  metric_names = ("accuracy",)

  def build_model(self):
    return _mlp()

  def train_data(self):
    arrays = _arrays(300, 1)

    def make():  # A user's tf.data pipeline: shuffle buffer and a map, seeded.
      dataset = tf.data.Dataset.from_tensor_slices(arrays).shuffle(64, seed=3)
      return dataset.map(lambda e: {"x": e["x"] * 2.0, "y": e["y"]})
    return make

  def eval_data(self):
    arrays = _arrays(50, 2)
    return lambda: tf.data.Dataset.from_tensor_slices(arrays)

  def per_example_loss(self, model, batch, training):
    loss, logits = _xent(model, batch, training)
    correct = tf.cast(tf.argmax(logits, -1) == batch["y"], tf.float32)
    return base_task.LossOutput(loss=loss, metrics={"accuracy": correct})


class NoMetrics(base_task.Task):
  def build_model(self):
    return _mlp()

  def train_data(self):
    return _arrays(200, 1)

  def eval_data(self):
    return _arrays(40, 2)

  def per_example_loss(self, model, batch, training):
    return base_task.LossOutput(loss=_xent(model, batch, training)[0])


class GradientPenalty(NoMetrics):
  """Cross-entropy plus a penalty on the input gradient of the first logit, per example: a loss
  that differentiates the model (its per-example gradients need the general path)."""

  def per_example_loss(self, model, batch, training):
    x = tf.convert_to_tensor(batch["x"])
    with tf.GradientTape() as inner:
      inner.watch(x)
      logits = model(x, training=training)
      first = tf.reduce_sum(logits[:, 0])
    penalty = tf.reduce_sum(tf.square(inner.gradient(first, x)), 1)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["y"], logits=logits)
    return base_task.LossOutput(loss=loss + 0.1 * penalty)


class HardExampleWeights(NoMetrics):
  """Cross-entropy weighted by a softmax of the losses over the batch: each example's loss
  depends on the others' (no direct formula gives its own gradient; the general path does)."""

  def per_example_loss(self, model, batch, training):
    loss = _xent(model, batch, training)[0]
    return base_task.LossOutput(loss=loss * tf.nn.softmax(loss))


class CenteredBatch(NoMetrics):
  """A model that subtracts the batch mean after its first layer: every recorded layer's
  output gradient rows mix the examples, also the layer before the mixing."""

  def build_model(self):
    keras.utils.set_random_seed(0)
    x = keras.Input((12,))
    h = keras.layers.Dense(16, activation="tanh")(x)
    h = keras.layers.Lambda(lambda t: t - tf.reduce_mean(t, 0, keepdims=True))(h)
    return keras.Model(x, keras.layers.Dense(2)(h))


class ActivityRegularised(NoMetrics):
  """An L2 activity regulariser on the logits (Keras divides it by the batch size)."""

  def build_model(self):
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(2, activity_regularizer=keras.regularizers.l2(0.05))])


class WeightPenaltyInLoss(NoMetrics):
  """Each example's loss adds an L2 penalty on the first Dense kernel, written in the loss: the
  kernel is read outside its layer's call, and every example's gradient holds the penalty's."""

  def per_example_loss(self, model, batch, training):
    penalty = 0.05 * tf.reduce_sum(tf.square(model.layers[0].kernel))
    return base_task.LossOutput(loss=_xent(model, batch, training)[0] + penalty)


class KernelRegularised(NoMetrics):
  """A Keras kernel regulariser: part of the batch objective (`model.losses`), not of any
  example's loss, so the per-example terms keep their direct formulas."""

  def build_model(self):
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((12,)), keras.layers.Dense(16, activation="tanh", kernel_regularizer="l2"),
        keras.layers.Dense(2)])


class InferenceBatchNorm(NoMetrics):
  """A subclassed model calling its (trainable) BatchNormalization with training=False."""

  def build_model(self):

    class Model(keras.Model):

      def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.norm = keras.layers.BatchNormalization()
        self.out = keras.layers.Dense(2)

      def call(self, x, training=False):
        return self.out(self.norm(self.hidden(x), training=False))

    keras.utils.set_random_seed(0)
    model = Model()
    model(np.zeros((1, 12), np.float32))
    return model


class UnusedHead(NoMetrics):
  """Two heads on one hidden layer; the loss reads only the first (the second gets no gradient)."""

  def build_model(self):
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return keras.Model(inputs, [keras.layers.Dense(2)(hidden),
                                keras.layers.Dense(3, name="unused_head")(hidden)])

  def per_example_loss(self, model, batch, training):
    logits, _ = model(batch["x"], training=training)
    return base_task.LossOutput(loss=tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=batch["y"], logits=logits))


class ConstantLoss(NoMetrics):
  def per_example_loss(self, model, batch, training):
    return base_task.LossOutput(loss=tf.reduce_sum(tf.square(batch["x"]), axis=1))


class BadLoss(NoMetrics):
  def per_example_loss(self, model, batch, training):
    return base_task.LossOutput(loss=_xent(model, batch, training)[0][:, None])


class OneHotOfAnotherWidth(NoMetrics):
  """One-hot labels of 3 classes against the model's 2 logits: Keras' ValueError, raised in this
  file while the step is traced."""

  def per_example_loss(self, model, batch, training):
    logits = model(batch["x"], training=training)
    labels = tf.one_hot(batch["y"], 3)
    return base_task.LossOutput(loss=keras.losses.categorical_crossentropy(labels, logits))


class LabelsOutOfRange(NoMetrics):
  """Labels 5 for a two-class model in every seventh example: TF's kernel rejects the batch."""

  def train_data(self):
    arrays = _arrays(200, 1)
    arrays["y"][5::7] = 5
    return arrays


class MaskedLoss(NoMetrics):
  """Leaves examples out with tf.boolean_mask (fewer losses than examples, length unknown)."""

  def per_example_loss(self, model, batch, training):
    loss = _xent(model, batch, training)[0]
    return base_task.LossOutput(loss=tf.boolean_mask(loss, batch["x"][:, 0] <= 1.0))


class IdsOutOfVocabulary(NoMetrics):
  """Token ids up to 60 into an Embedding(50, 4)."""

  def build_model(self):
    tokens = keras.Input((4,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 4)(tokens))
    return keras.Model(tokens, keras.layers.Dense(2)(pooled))

  def train_data(self):
    tokens = np.random.RandomState(0).randint(0, 61, (200, 4)).astype(np.int32)
    return {"x": tokens, "y": (tokens[:, 0] > 25).astype(np.int64)}

  def eval_data(self):
    return None


class BadData(NoMetrics):
  def train_data(self):
    raise base_task.DataError("my_records.tfrecord: field `label` has 11 classes, expected 10")


class Flaky(NoMetrics):
  """Every example of two batches in three has a NaN loss (with data.shuffle=False, batch 16)."""

  def train_data(self):
    arrays = _arrays(480, 1)
    arrays["poison"] = ((np.arange(480) // 16) % 3 != 0).astype(np.float32)
    return arrays

  def per_example_loss(self, model, batch, training):
    loss = _xent(model, {"x": batch["x"], "y": batch["y"]}, training)[0]
    if "poison" not in batch:  # Evaluation data (NoMetrics'): no poison field, finite losses.
      return base_task.LossOutput(loss=loss)
    return base_task.LossOutput(loss=tf.where(batch["poison"] > 0, float("nan"), loss))


class NanFromUpdate4(Flaky):
  """The first three batches of 16 are finite, every example after them has a NaN loss."""

  def train_data(self):
    arrays = _arrays(480, 1)
    arrays["poison"] = ((np.arange(480) // 16) >= 3).astype(np.float32)
    return arrays


class _SlowRecords:
  """An indexable source whose records take 20 ms each to read (a slow disk)."""

  def __init__(self):
    self._arrays = _arrays(256, 1)

  def __len__(self):
    return 256

  def __getitem__(self, i):
    time.sleep(0.02)
    return {name: values[i] for name, values in self._arrays.items()}


class SlowRecords(NoMetrics):
  """Training data read record by record by slow Python code (through tf.numpy_function)."""

  def train_data(self):
    return _SlowRecords()

  def eval_data(self):
    return None


class SlowEvaluation(NoMetrics):
  """Each evaluation batch takes 0.3 s more (a sleep in the loss, in evaluation only)."""

  def per_example_loss(self, model, batch, training):
    out = super().per_example_loss(model, batch, training)
    if training:
      return out
    slept = tf.numpy_function(lambda: np.float32(time.sleep(0.3) or 0.0), [], tf.float32,
                              stateful=True)
    return base_task.LossOutput(loss=out.loss + slept)


class _TiedOutput(keras.layers.Layer):
  """Logits from the embedding matrix itself (weight tying through other code)."""

  def __init__(self, embedding, **kwargs):
    super().__init__(**kwargs)
    self.embedding = embedding

  def call(self, x):
    return tf.matmul(x, self.embedding.embeddings, transpose_b=True)


class TiedEmbeddings(NoMetrics):
  """Tokens -> Embedding -> mean -> Dense -> logits through the SAME embedding matrix."""

  def build_model(self):
    tokens = keras.Input((4,), dtype="int32")
    embedding = keras.layers.Embedding(2, 6)
    x = keras.layers.Dense(6)(keras.layers.GlobalAveragePooling1D()(embedding(tokens)))
    return keras.Model(tokens, _TiedOutput(embedding)(x))

  @staticmethod
  def model_embedding(model):
    return next(l for l in model.layers if isinstance(l, keras.layers.Embedding))

  def train_data(self):
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 2, (128, 4)).astype(np.int32)
    return {"x": tokens, "y": (tokens.sum(1) > 1).astype(np.int64)}

  def eval_data(self):
    return None


class WithDropout(NoMetrics):
  """The MLP with Dropout: a resumed run must draw the masks an uninterrupted one draws."""

  def build_model(self):
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dropout(0.5), keras.layers.Dense(2)])


class NoiseKeptByTheTask(NoMetrics):
  """Input noise from a SeedGenerator and a GaussianNoise layer that the task keeps, not the
  model: a resumed run must draw the noise an uninterrupted one draws."""

  def build_model(self):
    self.noise = keras.random.SeedGenerator(7)
    self.augment = [keras.layers.GaussianNoise(0.3, seed=3)]
    return _mlp()

  def per_example_loss(self, model, batch, training):
    x = batch["x"]
    if training:
      x = self.augment[0](x + 0.5 * keras.random.normal(tf.shape(x), seed=self.noise),
                          training=True)
    return base_task.LossOutput(loss=_xent(model, {"x": x, "y": batch["y"]}, training)[0])


class _CountingScale(keras.layers.Layer):
  """A scale of its own (`add_weight`: no direct formula, the general path) that counts its
  training calls and keeps a running mean of its input: state written in the forward."""

  def build(self, input_shape):
    self.scale = self.add_weight(shape=input_shape[-1:], initializer="ones", name="scale")
    self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")
    self.mean = self.add_weight(shape=input_shape[-1:], initializer="zeros", trainable=False,
                                name="mean")

  def call(self, x, training=False):
    if training:
      self.calls.assign_add(1.0)
      self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, axis=0))
    return x * self.scale


class DropoutAndState(NoMetrics):
  """The MLP with Dropout behind `_CountingScale`: with per-example statistics on, the general
  path runs the forward again, once per example."""

  def build_model(self):
    return keras.Sequential([keras.Input((12,)), _CountingScale(),
                             keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dropout(0.5), keras.layers.Dense(2)])


class PerStepDense(keras.layers.Layer):
  """A Dense applied to each of 3 steps of 4 features by tf.map_fn (a loop in the forward)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = keras.layers.Dense(4)

  def call(self, x):
    steps = tf.transpose(tf.reshape(x, [-1, 3, 4]), [1, 0, 2])
    return tf.reshape(tf.transpose(tf.map_fn(self.dense, steps), [1, 0, 2]), [-1, 12])


class LoopedDense(NoMetrics):
  """The MLP behind a layer that calls a Dense inside tf.map_fn."""

  def build_model(self):
    return keras.Sequential([keras.Input((12,)), PerStepDense(), keras.layers.Dense(2)])


class _TokenAndPosition(keras.layers.Layer):
  """Token embedding plus a position embedding over arange(T) (Keras' text-example pattern)."""

  def __init__(self, length, width, **kwargs):
    super().__init__(**kwargs)
    self.length = length
    self.tokens = keras.layers.Embedding(10, width)
    self.positions = keras.layers.Embedding(length, width)

  def call(self, ids):
    return self.tokens(ids) + self.positions(keras.ops.arange(self.length))


class Recurrent(NoMetrics):
  """An LSTM over the 12 features read as 4 steps of 3: no direct formula, a while loop."""

  def build_model(self):
    features = keras.Input((12,))
    x = keras.layers.LSTM(5)(keras.layers.Reshape((4, 3))(features))
    return keras.Model(features, keras.layers.Dense(2)(x))


class PositionTransformer(NoMetrics):
  """Tokens -> token + position embeddings -> attention + LayerNormalization -> pooled logits.

  Its position Embedding's input does not depend on the batch: per-example code must send it
  to the general path."""

  def build_model(self):
    tokens = keras.Input((4,), dtype="int32")
    x = _TokenAndPosition(4, 8)(tokens)
    x = keras.layers.LayerNormalization()(
        x + keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(x, x))
    return keras.Model(tokens, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x)))

  def train_data(self):
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 10, (128, 4)).astype(np.int32)
    return {"x": tokens, "y": (tokens[:, 0] > 6).astype(np.int64)}

  def eval_data(self):
    return None
