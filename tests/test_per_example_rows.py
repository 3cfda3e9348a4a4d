"""Where the examples are in a covered layer's input (axis_rules.py, labelling.py).

A covered layer whose input holds the batch's rows on another axis (time-major [T, B, F] with
T == B) or in another order (x[::-1], a gather of a permutation) used to get silently permuted
per-example gradients (docs/known_issues.md, 8): its leading size equals B and its values depend
on the batch. Such layers must take the general path and match the single-example loop, eagerly
and traced, also through tf.cond and nested tf.functions. The common Keras models (RNN states,
masked attention, EinsumDense, TimeDistributed, ...) must keep their direct formulas: a false
demotion is exact but slow.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_helpers as h
from trainer.per_example import Recorder
from trainer.per_example import axis_rules
from trainer.per_example import labelling
from trainer.per_example import per_example_gradients

L = keras.layers
B, T, F = 6, 6, 4  # B == T: no shape check can tell the axes apart.
Examples, MOVED = axis_rules.Examples, axis_rules.MOVED

# (name, function of x [B, T, F], expected label of its result).
LABELS = [
    ("identity", lambda x: x * 2.0, Examples(0, 1, B)),
    ("time_step", lambda x: x[:, 0], Examples(0, 1, B)),
    ("last_feature_reversed", lambda x: x[..., ::-1], Examples(0, 1, B)),
    ("new_axis_first", lambda x: x[None], Examples(1, 1, B)),
    ("rows_reversed", lambda x: x[::-1], MOVED),
    ("rows_from_one", lambda x: x[1:], MOVED),
    ("one_example", lambda x: x[2], MOVED),
    ("time_major", lambda x: tf.transpose(x, [1, 0, 2]), Examples(1, 1, B)),
    ("time_major_and_back", lambda x: tf.transpose(tf.transpose(x, [1, 0, 2]), [1, 0, 2]),
     Examples(0, 1, B)),
    ("steps_flattened", lambda x: tf.reshape(x, [B * T, F]), Examples(0, T, B)),
    ("steps_flattened_and_back", lambda x: tf.reshape(tf.reshape(x, [B * T, F]), [B, T * F]),
     Examples(0, 1, B)),
    ("time_major_flattened_and_back", lambda x: tf.transpose(tf.reshape(tf.reshape(
        tf.transpose(x, [1, 0, 2]), [T * B, F]), [T, B, F]), [1, 0, 2]), Examples(0, 1, B)),
    ("reshaped_across_examples", lambda x: tf.reshape(tf.transpose(x, [1, 0, 2]), [B, T, F]),
     Examples(1, 1, B)),  # Row i holds step i of every example: axis 0 is not the examples.
    ("einsum_projection", lambda x: tf.einsum("btf,fo->bto", x, tf.ones([F, 3])),
     Examples(0, 1, B)),
    ("einsum_ellipsis", lambda x: tf.einsum("...f,fo->...o", x, tf.ones([F, 3])),
     Examples(0, 1, B)),
    ("einsum_time_major", lambda x: tf.einsum("btf->tbf", x), Examples(1, 1, B)),
    ("einsum_over_examples", lambda x: tf.einsum("btf,btg->fg", x, x), MOVED),
    ("mean_over_examples", lambda x: tf.reduce_mean(x, 0), MOVED),
    ("centred", lambda x: x - tf.reduce_mean(x, 0, keepdims=True), MOVED),  # Mixed.,
    ("mean_over_steps", lambda x: tf.reduce_mean(x, 1), Examples(0, 1, B)),
    ("stacked", lambda x: tf.stack([x, x]), Examples(1, 1, B)),
    ("unstacked_steps", lambda x: tf.unstack(x, axis=1)[0], Examples(0, 1, B)),
    ("concat_features", lambda x: tf.concat([x, x], -1), Examples(0, 1, B)),
    ("concat_examples", lambda x: tf.concat([x, x], 0), MOVED),
    ("gather_permutation", lambda x: tf.gather(x, [5, 4, 3, 2, 1, 0]), MOVED),
    ("gather_steps", lambda x: tf.gather(x, [0, 2], axis=1), Examples(0, 1, B)),
    ("shuffle", lambda x: tf.random.shuffle(x), MOVED),
    ("sorted_over_examples", lambda x: tf.sort(x, axis=0), MOVED),
    ("sorted_over_features", lambda x: tf.sort(x, axis=-1), Examples(0, 1, B)),
    ("unique_rows", lambda x: tf.unique(x[:, 0, 0])[0], MOVED),
    ("roll_examples", lambda x: tf.roll(x, 1, 0), MOVED),
    ("roll_steps", lambda x: tf.roll(x, 1, 1), Examples(0, 1, B)),
    ("reverse_examples", lambda x: tf.reverse(x, [0]), MOVED),
    ("tile_steps", lambda x: tf.tile(x, [1, 2, 1]), Examples(0, 1, B)),
    ("tile_examples", lambda x: tf.tile(x, [2, 1, 1]), MOVED),
    ("matmul_rows", lambda x: tf.matmul(x[:, 0], tf.ones([F, 3])), Examples(0, 1, B)),
    ("matmul_over_examples", lambda x: tf.matmul(x[:, 0], x[:, 0], transpose_a=True), MOVED),
    ("batched_matmul", lambda x: tf.matmul(x, x, transpose_b=True), Examples(0, 1, B)),
    ("from_shape_only", lambda x: tf.ones(tf.shape(x)), None),
    ("cumsum_over_examples", lambda x: tf.cumsum(x, 0), MOVED),
    ("cumsum_over_steps", lambda x: tf.cumsum(x, 1), Examples(0, 1, B)),
    ("pooled_over_examples", lambda x: tf.transpose(tf.nn.max_pool1d(
        tf.transpose(x, [1, 0, 2]), 2, 1, "SAME"), [1, 0, 2]), MOVED),
    ("pooled_over_steps", lambda x: tf.nn.max_pool1d(x, 2, 1, "SAME"), Examples(0, 1, B)),
    ("softmax_over_examples", lambda x: tf.nn.softmax(x, axis=0), MOVED),
    ("softmax_over_features", lambda x: tf.nn.softmax(x), Examples(0, 1, B)),
    ("bias_from_the_batch", lambda x: tf.nn.bias_add(tf.zeros([T, B]), x[:, 0, 0]), MOVED),
    ("segment_sum", lambda x: tf.math.unsorted_segment_sum(x, [5, 4, 3, 2, 1, 0], B), MOVED),
    ("inverse_over_examples", lambda x: tf.linalg.inv(x[:, :, 0]), MOVED),  # No rule: MOVED.
    ("fft_over_examples", lambda x: tf.transpose(tf.signal.fft(tf.cast(
        tf.transpose(x, [1, 2, 0]), tf.complex64)), [2, 0, 1]), MOVED),
    ("fft_over_features", lambda x: tf.signal.fft(tf.cast(x, tf.complex64)), Examples(0, 1, B)),
    ("image_transform", lambda x: tf.raw_ops.ImageProjectiveTransformV3(
        images=x[..., None], transforms=tf.constant([[1.0, 0, 1, 0, 1, 0, 0, 0]]),
        output_shape=[T, F], fill_value=0.0, interpolation="NEAREST"), Examples(0, 1, B)),
    ("py_function", lambda x: tf.py_function(lambda v: v[::-1], [x], tf.float32), MOVED),
    ("identity_n", lambda x: tf.identity_n([x[::-1], x])[1], Examples(0, 1, B)),
    ("custom_gradient", lambda x: tf.custom_gradient(lambda v: (v * 2.0, lambda d: d * 2.0))(x),
     Examples(0, 1, B)),
    ("padded_steps", lambda x: tf.pad(x, [[0, 0], [1, 1], [0, 0]]), Examples(0, 1, B)),
    ("padded_examples", lambda x: tf.pad(x, [[1, 0], [0, 0], [0, 0]]), MOVED),
    ("resized", lambda x: tf.image.resize(x[..., None], [3, 3]), Examples(0, 1, B)),
    ("one_hot", lambda x: tf.one_hot(tf.cast(x[:, :, 0] > 0, tf.int32), 2), Examples(0, 1, B)),
    ("dilated_convolution", lambda x: tf.nn.convolution(x, tf.ones([3, F, 2]), dilations=2),
     Examples(0, 1, B)),  # SpaceToBatchND, the convolution, BatchToSpaceND.
    ("cond_reversed", lambda x: tf.cond(tf.reduce_sum(x) > 0, lambda: x, lambda: x[::-1]), MOVED),
    ("cond_same", lambda x: tf.cond(tf.reduce_sum(x) > 0, lambda: x, lambda: -x),
     Examples(0, 1, B)),
    ("nested_function_time_major",
     lambda x: tf.function(lambda v: tf.transpose(v, [1, 0, 2]))(x), Examples(1, 1, B)),
    ("scan_state", lambda x: tf.scan(lambda s, v: s + v, tf.transpose(x, [1, 0, 2]))[-1],
     Examples(0, 1, B)),
]


@pytest.mark.parametrize("name,fn,expected", LABELS, ids=[n for n, _, _ in LABELS])
def test_the_label_of_each_op_pattern(name, fn, expected):
  found = {}

  def traced(x):
    out = fn(x)
    found["label"] = labelling.Labeller({x.ref(): Examples(0, 1, B)}).label(out)[0]
    return out
  tf.function(traced).get_concrete_function(tf.TensorSpec([B, T, F]))
  assert found["label"] == expected, name


class TimeMajorDense(L.Layer):
  """A Dense applied to the time-major transpose [T, B, F] of its input, then transposed back."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = L.Dense(5, activation="tanh")

  def call(self, x):
    return tf.transpose(self.dense(tf.transpose(x, [1, 0, 2])), [1, 0, 2])


class PermutedDense(L.Layer):
  """A Dense on the batch's rows in another order or mixed across examples (`how`), put back
  in order afterwards where they were reordered."""

  def __init__(self, how, **kwargs):
    super().__init__(**kwargs)
    self.how = how
    self.dense = L.Dense(5, activation="tanh")

  def call(self, x):
    order = tf.reverse(tf.range(tf.shape(x)[0]), [0])  # (Any batch size: the general path.)
    if self.how == "reversed":
      return self.dense(x[::-1])[::-1]
    if self.how == "gather":
      return tf.gather(self.dense(tf.gather(x, order)), order)
    if self.how == "cumsum":  # Mixed: row i sums examples 0..i.
      return self.dense(tf.cumsum(x, 0))
    if self.how == "centred":  # A hand-written batch normalisation: mixed.
      return self.dense(x - tf.reduce_mean(x, 0, keepdims=True))
    if self.how == "cond":  # Reversed in one branch only.
      rows = tf.cond(tf.reduce_sum(x) > -1e9, lambda: x[::-1], lambda: x)
      return tf.cond(tf.reduce_sum(x) > -1e9, lambda: self.dense(rows)[::-1],
                     lambda: self.dense(rows))
    inner = tf.function(lambda v: tf.transpose(v, [1, 0, 2]))  # "nested_function"
    return inner(self.dense(inner(x)))


def _model(layer):
  keras.utils.set_random_seed(0)
  x = keras.Input((T, F))
  return keras.Model(x, L.Dense(2)(L.Flatten()(L.Dense(3)(layer(x)))))


CASES = {"time_major": TimeMajorDense, "reversed": lambda: PermutedDense("reversed"),
         "gather": lambda: PermutedDense("gather"), "cond": lambda: PermutedDense("cond"),
         "nested_function": lambda: PermutedDense("nested_function"),
         "cumsum": lambda: PermutedDense("cumsum"), "centred": lambda: PermutedDense("centred")}


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  return (tf.constant(rng.normal(size=(B, T, F)), tf.float32),
          tf.constant(rng.integers(0, 2, B), tf.int32))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_on_another_axis_or_in_another_order_match_the_loop(case, traced):
  layer = CASES[case]()
  model = _model(layer)
  batch = _batch()
  fn = lambda b: per_example_gradients(model, h.xent, b)
  h.assert_close_rel(tf.function(fn)(batch) if traced else fn(batch),
                     h.loop_grads(model, h.xent, batch, model.trainable_variables), 1e-5, case)
  recorder = Recorder(model)
  recorder.scout(h.xent, batch)
  demoted = {layer.name for layer, _ in recorder.demoted}
  assert layer.dense.name in demoted, (case, recorder.demoted)
  if case in ("time_major", "nested_function"):  # Back in order: the layers after it are not.
    assert demoted == {layer.dense.name}, (case, recorder.demoted)


def _sequence_model(body, ids=False, mask=False):
  keras.utils.set_random_seed(0)
  x = keras.Input((T,), dtype="int32") if ids else keras.Input((T, F))
  z = L.Embedding(20, 8, mask_zero=mask)(x) if ids else x
  return keras.Model(x, L.Dense(2)(body(z)))


def _masked_attention(z):
  return L.GlobalAveragePooling1D()(L.LayerNormalization()(z + L.MultiHeadAttention(2, 4)(z, z)))


COMMON = {
    "lstm_last_output": lambda: _sequence_model(lambda z: L.LSTM(5)(z)),
    "lstm_state": lambda: _sequence_model(
        lambda z: L.Dense(3)(L.LSTM(5, return_state=True)(z)[1])),
    "gru_sequences": lambda: _sequence_model(
        lambda z: L.Flatten()(L.Dense(3)(L.GRU(5, return_sequences=True)(z)))),
    "bidirectional": lambda: _sequence_model(lambda z: L.Bidirectional(L.LSTM(5))(z)),
    "causal_conv1d": lambda: _sequence_model(
        lambda z: L.GlobalMaxPooling1D()(L.Conv1D(5, 3, padding="causal")(z)), ids=True),
    "masked_attention": lambda: _sequence_model(_masked_attention, ids=True, mask=True),
    "time_distributed": lambda: _sequence_model(
        lambda z: L.Flatten()(L.TimeDistributed(L.Dense(3))(z))),
    "einsum_dense": lambda: _sequence_model(
        lambda z: L.Flatten()(L.EinsumDense("abc,cd->abd", (T, 3))(z))),
    "dilated_conv1d": lambda: _sequence_model(lambda z: L.Flatten()(L.Conv1D(
        3, 3, dilation_rate=2, padding="same")(L.Conv1D(4, 2, dilation_rate=2)(z)))),
    "time_major_and_back": lambda: _sequence_model(
        lambda z: L.Flatten()(L.Dense(3)(TimeMajorDense()(z)))),
}


@pytest.mark.parametrize("name", sorted(COMMON))
def test_common_models_keep_their_direct_formulas(name):
  model = COMMON[name]()
  rng = np.random.default_rng(0)
  x = (tf.constant(rng.integers(0, 20, size=(B, T)), tf.int32) if name in (
      "causal_conv1d", "masked_attention") else tf.constant(rng.normal(size=(B, T, F)),
                                                            tf.float32))
  recorder = Recorder(model)
  recorder.scout(h.xent, (x, tf.constant(rng.integers(0, 2, B), tf.int32)))
  assert recorder.layers, name
  expected = ({model.layers[1].dense.name} if name == "time_major_and_back" else set())
  assert {layer.name for layer, _ in recorder.demoted} == expected, recorder.demoted


class RaggedToDense(keras.Model):
  """Ragged token ids made dense inside the model, then Embedding -> pooling -> Dense."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.embedding = L.Embedding(20, 4)
    self.dense = L.Dense(2)

  def call(self, ragged_ids):
    return self.dense(tf.reduce_mean(self.embedding(ragged_ids.to_tensor(shape=[None, 3])), 1))


def test_a_ragged_batch_made_dense_in_the_model_keeps_its_direct_formulas():
  keras.utils.set_random_seed(0)
  model = RaggedToDense()
  batch = (tf.ragged.constant([[1, 2, 3], [4], [5, 6]]), tf.constant([0, 1, 1]))
  model(batch[0])
  recorder = Recorder(model)
  recorder.scout(h.xent, batch)
  assert recorder.layers and not recorder.demoted, recorder.demoted
  grads = tf.function(lambda b: per_example_gradients(model, h.xent, b))(batch)
  h.assert_close_rel(grads, h.loop_grads(model, h.xent, batch, model.trainable_variables), 1e-5,
                     "ragged to dense")


@pytest.mark.parametrize("labels, expected", [
    ([Examples(0, 1, None), Examples(0, 1, 3)], Examples(0, 1, 3)),  # Ragged rows + labels.
    ([Examples(0, 1, 3), None], Examples(0, 1, 3)),
    ([Examples(0, 1, 3), Examples(0, 1, 5)], MOVED),
    ([Examples(0, 1, None), Examples(1, 1, 3)], MOVED),
    ([Examples(0, 2, None), Examples(0, 1, 3)], MOVED),
    ([Examples(0, 1, 3), MOVED], MOVED),
    ([None, None], None),
])
def test_labels_of_two_inputs_agree_only_on_one_axis_and_size(labels, expected):
  assert axis_rules.moves.agreed(labels) == expected
