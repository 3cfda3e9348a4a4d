"""Shared by the per-example tests and their subprocess worker: models, batches, the oracle.

The oracle is the loop of single-example GradientTapes (eager), the definition of a
per-example gradient. Tolerances (see `assert_close_rel`): max|ours - loop| <= rel * max|loop|
per variable over the whole [B, ...] tensor, the scale floored at 0.1 x the largest entry of any
variable, for gradients that are exactly zero up to rounding (e.g. the attention key bias, which
softmax ignores).
"""
import keras
import numpy as np
import tensorflow as tf

from trainer.bench.per_example import text_transformer  # pylint: disable=unused-import

L = keras.layers


def xent(model, batch):
  x, y = batch
  logits = model(x, training=True)
  return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def conv_mix():
  """Conv1D, strided SAME Conv2D, DepthwiseConv2D, SeparableConv2D, Conv2DTranspose,
  GroupNormalization, UnitNormalization and Dense on rank-3 inputs; [B, 12, 10, 3] -> 3 classes."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((12, 10, 3))
  h = L.Conv2D(4, 3, strides=2, padding="same", activation="relu")(inputs)      # [6, 5, 4]
  h = L.DepthwiseConv2D(3, depth_multiplier=2, padding="same")(h)               # [6, 5, 8]
  h = L.SeparableConv2D(6, 3, padding="same", activation="relu")(h)             # [6, 5, 6]
  h = L.Conv2DTranspose(3, 3, strides=2, padding="same", activation="relu")(h)  # [12, 10, 3]
  h = L.GroupNormalization(groups=3)(h)
  h = L.UnitNormalization()(h)
  h = L.Reshape((12, 30))(h)
  h = L.Conv1D(5, 3, activation="relu")(h)                                      # [10, 5]
  h = L.Dense(4, activation="tanh")(h)                                          # rank-3 input
  return keras.Model(inputs, L.Dense(3)(L.Flatten()(h)))


class Scale(L.Layer):
  """A layer no rule knows: per-feature scale (general path)."""

  def build(self, input_shape):
    self.scale = self.add_weight(shape=input_shape[-1:], initializer="ones", name="scale")

  def call(self, x):
    return x * self.scale


def batch_for(model, size, seed=0, classes=3):
  """Random inputs matching `model.inputs[0]` (ids in [0, 10): duplicates within examples)."""
  rng = np.random.default_rng(seed)
  shape = (size,) + tuple(model.inputs[0].shape[1:])
  if model.inputs[0].dtype.startswith("int"):
    x = rng.integers(0, 10, size=shape).astype(np.int32)
  else:
    x = rng.normal(size=shape).astype(np.float32)
  y = rng.integers(0, classes, size=(size,)).astype(np.int32)
  return tf.constant(x), tf.constant(y)


def loop_grads(model, loss_fn, batch, variables):
  """The oracle: [B, *shape] numpy per variable from B single-example tapes (eager)."""
  size = tf.nest.flatten(batch)[0].shape[0]
  rows = []
  for i in range(size):
    example = tf.nest.map_structure(lambda t, i=i: t[i:i + 1], batch)
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(loss_fn(model, example))
    grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    rows.append([tf.convert_to_tensor(g).numpy() for g in grads])
  return [np.stack(col) for col in zip(*rows)]


def rel_errors(ours, ref):
  """Per variable max|a - b| / scale (scale floored as in the module docstring)."""
  floor = 0.1 * max(float(np.max(np.abs(b))) for b in ref)
  errors = []
  for a, b in zip(ours, ref):
    a = np.asarray(a)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    scale = max(float(np.max(np.abs(b))), floor, 1e-12)
    errors.append(float(np.max(np.abs(a - b))) / scale)
  return errors


def assert_close_rel(ours, ref, rel, what):
  errors = rel_errors(ours, ref)
  worst = int(np.argmax(errors))
  assert errors[worst] <= rel, f"{what} var {worst}: relative error {errors[worst]:.3g} > {rel}"
