"""Per-example losses that the direct formulas cannot serve, found by probing (issue 10).

* Losses that mix the examples (weights from a softmax over the batch's losses), or a layer
  after the recorded ones that does (`x - mean(x, 0)`): row i of every recorded output gradient
  then depends on the other examples, also in the layers BEFORE the mixing. Every layer must
  take the general path and match the single-example loop (<= 1e-5), eagerly and traced, for
  per-example gradients and ghost statistics; general_path='error' refuses in one line.
* The usual Keras losses keep every layer on its direct formula (their kernels are row by row).
* A loss of the wrong length ([2B], [B - 2]) or an integer dtype is one line, not wrong numbers.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_helpers as h
from trainer import per_example
from trainer.per_example import Recorder
from trainer.per_example import per_example_gradients

L = keras.layers
B = 5


class Center(L.Layer):
  """Subtracts the batch mean: the examples interact."""

  def call(self, x):
    return x - keras.ops.mean(x, axis=0, keepdims=True)


def _conv_dense():
  keras.utils.set_random_seed(0)
  x = keras.Input((4, 6))
  return keras.Model(x, L.Dense(3)(L.Flatten()(L.Conv1D(5, 2)(x))))


def _centred():
  keras.utils.set_random_seed(0)
  x = keras.Input((4, 6))
  return keras.Model(x, L.Dense(3)(Center()(L.Dense(4)(L.Flatten()(x)))))


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  return (tf.constant(rng.normal(size=(B, 4, 6)), tf.float32),
          tf.constant(rng.integers(0, 3, size=B), tf.int32))


def _softmax_weighted(model, batch):
  losses = h.xent(model, batch)
  return losses * tf.nn.softmax(losses) * float(B)


CASES = {"loss_mixes": (_conv_dense, _softmax_weighted), "layer_mixes": (_centred, h.xent)}


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_examples_mixed_after_the_recorded_layers_take_the_general_path(case, traced):
  make, loss_fn = CASES[case]
  model = make()
  batch = _batch()
  ref = h.loop_grads(model, loss_fn, batch, model.trainable_variables)
  fn = lambda b: per_example_gradients(model, loss_fn, b)
  ours = tf.function(fn)(batch) if traced else fn(batch)
  h.assert_close_rel(ours, ref, 1e-5, f"{case} per-example gradients")
  stats = per_example.ghost_statistics(model, loss_fn, batch)
  oracle = per_example.replica_statistics([tf.constant(r) for r in ref],
                                          model.trainable_variables)
  for key in ("norms", "cosines", "mean_norm"):
    np.testing.assert_allclose(stats[key], oracle[key], rtol=1e-5, atol=1e-6, err_msg=key)
  with pytest.raises(ValueError, match=r"cannot use its direct formula: (the per-example losses "
                                       r"depend on other examples' values|its input holds the "
                                       r"batch's rows in another order or mixed) \(after "):
    tf.function(lambda b: per_example_gradients(model, loss_fn, b, general_path="error"))(batch)


LOSSES = {
    "sparse_categorical": lambda y, p: keras.losses.sparse_categorical_crossentropy(
        y, p, from_logits=True),
    "categorical_smoothed": lambda y, p: keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=0.1, reduction=None)(tf.one_hot(y, 3), p),
    "tf_sparse_softmax": lambda y, p: tf.nn.sparse_softmax_cross_entropy_with_logits(y, p),
    "binary": lambda y, p: keras.losses.binary_crossentropy(tf.one_hot(y, 3), p,
                                                            from_logits=True),
    "huber": lambda y, p: keras.losses.huber(tf.one_hot(y, 3), p),
    "clipped": lambda y, p: tf.clip_by_value(keras.losses.sparse_categorical_crossentropy(
        y, p, from_logits=True), 0.0, 5.0),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_usual_losses_keep_the_direct_formulas(name):
  model = _conv_dense()
  loss_fn = lambda m, b: LOSSES[name](b[1], m(b[0], training=True))
  recorder = Recorder(model)
  tf.function(lambda b: recorder.differentiate(loss_fn, b)[2])(_batch())
  assert not recorder.general_indices, [v.path for v in recorder.general_variables]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_losses_of_the_wrong_length_or_dtype_are_one_line(traced):
  model = _conv_dense()
  batch = _batch()
  cases = {
      "twice": (lambda m, b: tf.concat([h.xent(m, b)] * 2, 0),
                r"one loss per example: got 10 losses for a batch of 5\.$"),
      "fewer": (lambda m, b: h.xent(m, b)[:3],
                r"one loss per example: got 3 losses for a batch of 5\.$"),
      "integer": (lambda m, b: tf.cast(10 * h.xent(m, b), tf.int32),
                  r"floating-point per-example losses; got int32, which has no gradient\.$"),
  }
  for name, (loss_fn, message) in cases.items():
    for call in (per_example_gradients, per_example.ghost_statistics):
      fn = lambda b: call(model, loss_fn, b)  # pylint: disable=cell-var-from-loop
      with pytest.raises(ValueError, match=message) as raised:
        (tf.function(fn) if traced else fn)(batch)
      assert "\n" not in str(raised.value), (name, str(raised.value))


def test_a_loss_of_the_wrong_length_under_a_dynamic_batch_size_fails_in_one_line():
  """(A slice of the losses reorders the rows: the general path's single-example forward then
  sees it while tracing; the run-time check covers what the graph does not show.)"""
  model = _conv_dense()
  spec = (tf.TensorSpec([None, 4, 6]), tf.TensorSpec([None], tf.int32))
  fn = tf.function(lambda b: per_example_gradients(model, lambda m, x: h.xent(m, x)[1:], b),
                   input_signature=[spec])
  with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="one loss per example"):
    fn(_batch())
