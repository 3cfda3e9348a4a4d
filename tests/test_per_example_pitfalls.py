"""Models users write that broke the per-example path (found by probing; docs/known_issues.md).

* A covered layer whose input's axis 0 is not the example axis: a position Embedding over
  `arange(T)` (Keras' TokenAndPositionEmbedding pattern), a Dense on a learned query that is
  broadcast over the examples, a Dense over [B*T, F]. Their variables must go to the general
  path and match the single-example loop (<= 1e-5), at B = 1, B != T and B == T (where a shape
  check cannot tell), eagerly and traced, for per-example gradients, ghost statistics and the
  trainer's hook.
* A forward inside an already-traced tf.function: refused in one line, not zeros.
* A general-path variable that the loss does not use: a zero gradient, not a crash.
* pfor through an LSTM traced with an unknown batch size, run on one example (a run-time
  failure of TF's pfor): matches the loop.
* A Dense on a tf.SparseTensor input: the general path, matching the loop.
* Weights read outside their layer's call (an output projection through the embedding matrix, a
  regulariser added to each example's loss): their layers take the general path.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import example_tasks
import per_example_helpers as h
from trainer import per_example
from trainer.per_example import Recorder
from trainer.per_example import per_example_gradients

L = keras.layers
T = 6  # Sequence length; batches of 6 make B == T.


class TokenAndPosition(L.Layer):
  """Token embedding plus a position embedding over arange(T), as in Keras' text examples."""

  def __init__(self, length, width, **kwargs):
    super().__init__(**kwargs)
    self.length = length
    self.tokens = L.Embedding(50, width)
    self.positions = L.Embedding(length, width)

  def call(self, ids):
    return self.tokens(ids) + self.positions(keras.ops.arange(self.length))


class LearnedQuery(L.Layer):
  """A Dense applied to a learned [rows, width] query (batch-independent), broadcast-added."""

  def __init__(self, rows, width, **kwargs):
    super().__init__(**kwargs)
    self.rows = rows
    self.project = L.Dense(width)

  def build(self, input_shape):
    self.query = self.add_weight(shape=(self.rows, input_shape[-1]), name="query")

  def call(self, x):
    return x + keras.ops.mean(self.project(self.query), axis=0)


class FlatSteps(L.Layer):
  """A Dense over the [B*T, F] reshape of [B, T, F]."""

  def __init__(self, width, **kwargs):
    super().__init__(**kwargs)
    self.dense = L.Dense(width, activation="tanh")

  def call(self, x):
    flat = keras.ops.reshape(x, (-1, x.shape[-1]))
    return keras.ops.reshape(self.dense(flat), (-1, x.shape[1], self.dense.units))


def position_transformer():
  """TokenAndPosition -> MultiHeadAttention + LayerNormalization -> Dense -> pooling -> Dense."""
  keras.utils.set_random_seed(0)
  ids = keras.Input((T,), dtype="int32")
  x = TokenAndPosition(T, 8)(ids)
  x = L.LayerNormalization()(x + L.MultiHeadAttention(num_heads=2, key_dim=4)(x, x))
  x = L.Dense(8, activation="relu")(x)
  return keras.Model(ids, L.Dense(2)(L.GlobalAveragePooling1D()(x)))


def query_and_flat_steps():
  """LearnedQuery (with T rows: B == T hides it from a shape check) and FlatSteps, on floats."""
  keras.utils.set_random_seed(0)
  x = keras.Input((T, 4))
  h_ = FlatSteps(5)(LearnedQuery(T, 4)(x))
  return keras.Model(x, L.Dense(2)(L.Flatten()(h_)))


MODELS = {"position_transformer": position_transformer, "query_and_flat_steps": query_and_flat_steps}


def _batch(model, size, seed=0):
  rng = np.random.default_rng(seed)
  if model.inputs[0].dtype.startswith("int"):
    x = tf.constant(rng.integers(0, 50, size=(size, T)), tf.int32)
  else:
    x = tf.constant(rng.normal(size=(size, T, 4)), tf.float32)
  labels = np.where(rng.random(size) < 0.8, 0, 1)  # A clear mean gradient (see test_ghost).
  return x, tf.constant(labels, tf.int32)


def _demoted_layers(name, model):
  if name == "position_transformer":
    return [model.layers[1].positions]
  return [model.layers[1].project, model.layers[2].dense, model.layers[1]]  # + its query.


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("size", [1, 4, T])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_example_gradients_match_the_loop_when_axis_zero_is_not_the_examples(name, size,
                                                                                 traced):
  model = MODELS[name]()
  batch = _batch(model, size)
  ref = h.loop_grads(model, h.xent, batch, model.trainable_variables)
  fn = lambda b: per_example_gradients(model, h.xent, b)
  ours = tf.function(fn)(batch) if traced else fn(batch)
  h.assert_close_rel(ours, ref, 1e-5, f"{name} B={size}")
  for g, r in zip(ours, ref):  # The sum over examples is the batch gradient.
    np.testing.assert_allclose(np.sum(g, 0), np.sum(r, 0), atol=1e-6 * max(1.0, np.abs(r).max()))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_recorder_demotes_exactly_those_layers_and_error_refuses_them(name):
  model = MODELS[name]()
  batch = _batch(model, T)
  recorder = Recorder(model)
  recorder.differentiate(h.xent, batch)
  if name == "position_transformer":  # Eager, arange(T) with T == B looks like a batch...
    assert not recorder.general_indices
  recorder.scout(h.xent, batch)  # ...the scout's scratch trace sees it does not depend on it.
  demoted = {id(v) for layer in _demoted_layers(name, model) for v in layer.trainable_variables}
  assert {id(v) for v in recorder.general_variables} == demoted
  if name == "position_transformer":  # (The other has a variable no rule covers.)
    with pytest.raises(ValueError, match=r"general_path='error' and .* cannot use its direct "
                                         r"formula: its input does not depend on the values of the batch"):
      tf.function(lambda b: per_example_gradients(model, h.xent, b, general_path="error"))(batch)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ghost_statistics_equal_the_materialised_oracle(name):
  model = MODELS[name]()
  batch = _batch(model, T)
  grads = per_example_gradients(model, h.xent, batch)
  ref = per_example.replica_statistics(grads, model.trainable_variables)
  for fn in (per_example.ghost_statistics,
             tf.function(lambda m, f, b: per_example.ghost_statistics(m, f, b))):
    ours = fn(model, h.xent, batch)
    for key in ("norms", "cosines", "var_norms", "diversity", "trace", "gns", "grad_norm"):
      a, b = np.asarray(ours[key], np.float64), np.asarray(ref[key], np.float64)
      assert a.shape == b.shape, key
      assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), key


def test_a_loss_inside_an_already_traced_function_is_refused_not_zeros():
  model = h.text_transformer(length=4)
  batch = (tf.constant(np.arange(12).reshape(3, 4), tf.int32), tf.constant([0, 1, 0], tf.int32))
  traced_loss = tf.function(h.xent)
  traced_loss(model, batch)  # Traced before any recording: calls reuse its graph.
  for fn in (lambda: per_example_gradients(model, traced_loss, batch),
             lambda: per_example.ghost_statistics(model, traced_loss, batch),
             lambda: tf.function(lambda b: per_example_gradients(model, traced_loss, b))(batch)):
    with pytest.raises(ValueError, match=r"'.*' was used by the forward pass but its call was "
                                         r"not recorded: .*tf.function"):
      fn()


def test_a_general_variable_the_loss_does_not_use_gets_zeros():
  keras.utils.set_random_seed(0)
  unused = h.Scale()
  model = keras.Sequential([keras.Input((3,)), h.Scale(), L.Dense(2)])
  unused.build((None, 3))
  batch = (tf.constant(np.ones((4, 3)), tf.float32), tf.constant([0, 1, 0, 1], tf.int32))
  variables = model.trainable_variables + unused.trainable_variables
  for path in ("vectorized_map", "loop"):
    grads = per_example_gradients(model, h.xent, batch, variables=variables, general_path=path)
    assert grads[-1].shape == (4, 3)
    assert float(tf.reduce_max(tf.abs(grads[-1]))) == 0.0
    assert float(tf.reduce_max(tf.abs(grads[0]))) > 0.0


def test_an_lstm_traced_for_any_batch_size_runs_one_example():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((5, 3)), L.LSTM(4), L.Dense(2)])
  fn = tf.function(lambda b: per_example_gradients(model, h.xent, b), input_signature=[(
      tf.TensorSpec([None, 5, 3]), tf.TensorSpec([None], tf.int32))])
  for size in (1, 3):
    batch = (tf.constant(np.random.default_rng(size).normal(size=(size, 5, 3)), tf.float32),
             tf.constant([1] * size, tf.int32))
    h.assert_close_rel(fn(batch), h.loop_grads(model, h.xent, batch, model.trainable_variables),
                       1e-5, f"B={size}")


def test_a_dense_on_a_sparse_input_takes_the_general_path(caplog):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((6,), sparse=True), L.Dense(3, activation="tanh"),
                            L.Dense(2)])
  dense = tf.constant(np.random.default_rng(0).normal(size=(4, 6)) * np.eye(4, 6), tf.float32)
  labels = tf.constant([0, 1, 0, 1], tf.int32)
  ours = per_example_gradients(model, h.xent, (tf.sparse.from_dense(dense), labels))
  h.assert_close_rel(ours, h.loop_grads(model, h.xent, (dense, labels),
                                        model.trainable_variables), 1e-5, "sparse")
  assert "its input is a tf.SparseTensor; its variables take the general path" in caplog.text


def _tied_embeddings():
  keras.utils.set_random_seed(0)
  tokens = keras.Input((T,), dtype="int32")
  embedding = L.Embedding(5, 6)
  x = L.Dense(6)(L.GlobalAveragePooling1D()(embedding(tokens)))
  return keras.Model(tokens, example_tasks._TiedOutput(embedding)(x))  # pylint: disable=protected-access


def _regularised_loss(model, batch):
  return h.xent(model, batch) + tf.add_n(model.losses)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_weights_read_outside_their_layer_take_the_general_path(traced):
  tied = _tied_embeddings()
  keras.utils.set_random_seed(0)
  regularised = keras.Sequential([
      keras.Input((4,)), L.Dense(5, activation="tanh", kernel_regularizer="l2"), L.Dense(2)])
  for model, loss_fn, outside in ((tied, h.xent, tied.layers[1]),
                                  (regularised, _regularised_loss, regularised.layers[0])):
    rng = np.random.default_rng(0)
    x = (tf.constant(rng.integers(0, 5, size=(4, T)), tf.int32) if model is tied
         else tf.constant(rng.normal(size=(4, 4)), tf.float32))
    batch = (x, tf.constant([0, 1, 1, 0], tf.int32))
    fn = lambda b, m=model, f=loss_fn: per_example_gradients(m, f, b)
    ours = tf.function(fn)(batch) if traced else fn(batch)
    h.assert_close_rel(ours, h.loop_grads(model, loss_fn, batch, model.trainable_variables),
                       1e-5, outside.name)
    recorder = Recorder(model)
    recorder.differentiate(loss_fn, batch)
    assert [id(v) for v in recorder.general_variables] == [
        id(v) for v in outside.trainable_weights], outside.name  # The whole layer.


def test_rows_that_are_not_examples_under_a_dynamic_batch_size_fail_in_one_line():
  keras.utils.set_random_seed(0)
  x = keras.Input((T, 4))
  model = keras.Model(x, L.Dense(2)(L.Flatten()(FlatSteps(5)(x))))
  fn = tf.function(lambda b: per_example_gradients(model, h.xent, b), input_signature=[(
      tf.TensorSpec([None, T, 4]), tf.TensorSpec([None], tf.int32))])
  batch = _batch(model, 3)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"per_example: Dense \w+: axis 0 of its input is not the example axis"):
    fn(batch)
  # With a static batch size the same layer takes the general path and matches the loop.
  h.assert_close_rel(tf.function(lambda b: per_example_gradients(model, h.xent, b))(batch),
                     h.loop_grads(model, h.xent, batch, model.trainable_variables), 1e-5, "static")


class PositionsFromShape(L.Layer):
  """Position ids from the input's shape, `arange(shape(ids)[-1])`, as Keras' text examples
  write them: under an unknown length they depend on the batch through its shape only."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.tokens = L.Embedding(50, 8)
    self.positions = L.Embedding(32, 8)

  def call(self, ids):
    return self.tokens(ids) + self.positions(keras.ops.arange(keras.ops.shape(ids)[-1]))


def test_positions_from_the_shape_of_a_batch_of_unknown_length_take_the_general_path():
  keras.utils.set_random_seed(0)
  ids = keras.Input((None,), dtype="int32")
  x = L.Dense(8, activation="tanh")(PositionsFromShape()(ids))
  model = keras.Model(ids, L.Dense(2)(L.GlobalAveragePooling1D()(x)))
  fn = tf.function(lambda b: per_example_gradients(model, h.xent, b), input_signature=[(
      tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.int32))])
  for size, length in ((5, 5), (3, 7)):
    rng = np.random.default_rng(size)
    batch = (tf.constant(rng.integers(0, 50, (size, length)), tf.int32),
             tf.constant(rng.integers(0, 2, size), tf.int32))
    ref = h.loop_grads(model, h.xent, batch, model.trainable_variables)
    h.assert_close_rel(fn(batch), ref, 1e-5, f"traced B={size} T={length}")
    h.assert_close_rel(per_example_gradients(model, h.xent, batch), ref, 1e-5, "eager")


class RaggedMean(L.Layer):
  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.embedding = L.Embedding(20, 4)
    self.dense = L.Dense(2)

  def call(self, ragged_ids):
    return self.dense(tf.reduce_mean(self.embedding(ragged_ids), axis=1))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_ragged_input_takes_the_general_path(traced):
  keras.utils.set_random_seed(0)
  model = RaggedMean()
  batch = (tf.ragged.constant([[1, 2, 3], [4], [5, 6]]), tf.constant([0, 1, 1]))
  model(batch[0])
  ref = h.loop_grads(model, h.xent, batch, model.trainable_variables)  # (Slices ragged rows.)
  fn = lambda b: per_example_gradients(model, h.xent, b)
  h.assert_close_rel(tf.function(fn)(batch) if traced else fn(batch), ref, 1e-5, "ragged")


class Rematerialised(L.Layer):
  """A Dense under tf.recompute_grad: its forward runs with gradient recording stopped."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = L.Dense(5, activation="tanh")

  def call(self, x):
    return tf.recompute_grad(self.dense)(x)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_layer_under_recompute_grad_takes_the_general_path(traced):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), Rematerialised(), L.Dense(2)])
  batch = (tf.constant(np.random.default_rng(0).normal(size=(5, 4)), tf.float32),
           tf.constant([0, 1, 1, 0, 1], tf.int32))
  fn = lambda b: per_example_gradients(model, h.xent, b)
  h.assert_close_rel(tf.function(fn)(batch) if traced else fn(batch),
                     h.loop_grads(model, h.xent, batch, model.trainable_variables), 1e-5,
                     "recompute_grad")  # Its gradients were zeros.


class CustomGradientDense(L.Layer):
  """A Dense inside a tf.custom_gradient function whose gradient the user writes (exact here)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = L.Dense(5)

  def call(self, x):
    @tf.custom_gradient
    def forward(v):
      def backward(dy, variables=None):
        return tf.matmul(dy, self.dense.kernel, transpose_b=True), [
            tf.matmul(v, dy, transpose_a=True) if len(w.shape) == 2 else tf.reduce_sum(dy, 0)
            for w in variables]
      return self.dense(v), backward
    return tf.tanh(forward(x))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_layer_inside_a_custom_gradient_takes_the_general_path(traced):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), CustomGradientDense(), L.Dense(2)])
  batch = (tf.constant(np.random.default_rng(1).normal(size=(6, 4)), tf.float32),
           tf.constant([0, 1, 1, 0, 1, 0], tf.int32))
  fn = lambda b: per_example_gradients(model, h.xent, b)
  # Traced, the backward went around the recorded output: its gradients were zeros.
  h.assert_close_rel(tf.function(fn)(batch) if traced else fn(batch),
                     h.loop_grads(model, h.xent, batch, model.trainable_variables), 1e-5,
                     "custom_gradient")


def test_the_general_path_runs_as_loop_where_pfor_fails_or_crashes(caplog):
  from trainer.per_example import general  # pylint: disable=g-import-not-at-top
  from trainer.per_example import kernels  # pylint: disable=g-import-not-at-top
  assert kernels.onednn_on()  # conftest turns oneDNN on: TF's default on newer x86 CPUs.
  dense = keras.Sequential([keras.Input((3,)), L.Dense(2)])
  attention = h.text_transformer(length=4)
  batch = (tf.zeros([2, 3]), tf.zeros([2], tf.int32))
  ragged = (tf.ragged.constant([[1], [2, 3]]), tf.zeros([2], tf.int32))
  assert general._chosen_path(dense, batch, "vectorized_map") == "vectorized_map"  # pylint: disable=protected-access
  assert general._chosen_path(dense, ragged, "vectorized_map") == "loop"  # pylint: disable=protected-access
  for _ in range(2):  # Logged once per model.
    assert general._chosen_path(attention, batch, "vectorized_map") == "loop"  # pylint: disable=protected-access
  assert caplog.text.count("runs as 'loop'") == 1
  assert general._chosen_path(attention, batch, "error") == "error"  # pylint: disable=protected-access


class HandWrittenProjection(L.Layer):
  """A layer of the user's own: `tf.matmul` of a [B, T, D] sequence and its [D, U] weight."""

  def build(self, shape):
    self.kernel = self.add_weight(shape=(shape[-1], 4), name="kernel")

  def call(self, x):
    return tf.matmul(x, self.kernel)


def test_batched_matmuls_of_an_unknown_layer_take_the_loop_not_pfor(caplog):
  """pfor of tf.matmul([1, 12, 16], [16, 8])'s gradient killed the process (SIGSEGV) at B = 4 on
  an Intel Xeon with oneDNN on, without microstep, and so did a hand-written attention layer
  through the trainer: the guard knew MultiHeadAttention only by class. It now finds the ops in
  the single-example graph; the answer still equals the single-example loop. A model without
  batched matmuls keeps pfor."""
  keras.utils.set_random_seed(0)
  tokens = keras.Input((12,), dtype="int32")
  x = HandWrittenProjection()(L.Embedding(50, 16)(tokens))
  model = keras.Model(tokens, L.Dense(2)(L.GlobalAveragePooling1D()(x)))
  rng = np.random.default_rng(3)
  batch = (tf.constant(rng.integers(0, 50, size=(7, 12)), tf.int32),
           tf.constant(rng.integers(0, 2, size=7), tf.int32))
  ours = tf.function(lambda b: per_example_gradients(model, h.xent, b))(batch)
  h.assert_close_rel(ours, h.loop_grads(model, h.xent, batch, model.trainable_variables), 1e-5,
                     "hand-written projection")
  assert "runs as 'loop'" in caplog.text and "BatchMatMulV2" in caplog.text, caplog.text
  caplog.clear()
  flat = keras.Sequential([keras.Input((3,)), h.Scale(), L.Dense(2)])
  flat_batch = (tf.constant(rng.normal(size=(7, 3)), tf.float32), batch[1])
  per_example_gradients(flat, h.xent, flat_batch)
  assert "runs as 'loop'" not in caplog.text, caplog.text


def _input_gradient_penalty(model, batch):
  """Cross-entropy plus |d logit_0 / d x|^2 per example: a loss that differentiates the model."""
  x, y = batch
  with tf.GradientTape() as inner:
    inner.watch(x)
    logits = model(x, training=True)
    first = tf.reduce_sum(logits[:, 0])
  penalty = tf.reduce_sum(tf.square(inner.gradient(first, x)), 1)
  return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True) + penalty


def _jvp_penalty(model, batch):
  """Cross-entropy plus |J(x) 1|^2 per example, by a ForwardAccumulator."""
  x, y = batch
  with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)) as accumulator:
    logits = model(x, training=True)
  penalty = tf.reduce_sum(tf.square(accumulator.jvp(logits)), 1)
  return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True) + penalty


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("loss_fn", [_input_gradient_penalty, _jvp_penalty],
                         ids=["gradient_tape", "forward_accumulator"])
def test_a_loss_that_differentiates_the_model_takes_the_general_path(loss_fn, traced):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), L.Dense(5, activation="tanh"), L.Dense(3)])
  rng = np.random.default_rng(0)
  batch = (tf.constant(rng.normal(size=(6, 4)), tf.float32),
           tf.constant(rng.integers(0, 3, 6), tf.int32))
  enter = tf.GradientTape.__enter__
  ref = h.loop_grads(model, loss_fn, batch, model.trainable_variables)
  fn = lambda b: per_example_gradients(model, loss_fn, b)
  # The direct formulas missed the path through the inner derivative: errors of 0.25-1.0.
  h.assert_close_rel(tf.function(fn)(batch) if traced else fn(batch), ref, 1e-5, "penalty")
  stats = tf.function(lambda b: per_example.ghost_statistics(model, loss_fn, b))(batch) if (
      traced) else per_example.ghost_statistics(model, loss_fn, batch)
  norms = np.sqrt(sum(np.sum(np.reshape(r, (6, -1)) ** 2, 1) for r in ref))
  np.testing.assert_allclose(stats["norms"], norms, rtol=1e-5)
  assert tf.GradientTape.__enter__ is enter  # The hooks are gone after the recording.


def _residual_mlp():
  x = keras.Input((6,))
  first = L.Dense(6)(x)
  return keras.Model(x, L.Dense(3)(first + L.Dense(6, activation="relu")(first)))


@pytest.mark.parametrize("build", [
    _residual_mlp,
    lambda: keras.Sequential([keras.Input((5, 4)), L.Dense(4), L.LSTM(3), L.Dense(3)])],
    ids=["residual_sum", "lstm"])
def test_one_example_traced_keeps_the_direct_formulas_and_matches_the_loop(build):
  """Traced at a static B=1, Keras squeezes axis 0 away in `x + y` and in RNNs: that read as
  losses that mix the examples, and every layer went to the general path (a probe,
  2026-12-07; `general_path='error'` refused the model, and so did the trainer at batch 1)."""
  keras.utils.set_random_seed(0)
  model = build()
  batch = h.batch_for(model, 1)
  covered = [v for v in model.trainable_variables if "lstm" not in v.path]  # (No formula.)
  fn = tf.function(lambda b: per_example_gradients(model, h.xent, b, variables=covered,
                                                   general_path="error"))
  h.assert_close_rel(fn(batch), h.loop_grads(model, h.xent, batch, covered), 1e-5, "B=1")
  stats = tf.function(lambda b: per_example.ghost_statistics(model, h.xent, b))(batch)
  grads = per_example_gradients(model, h.xent, batch)
  ref = per_example.replica_statistics(grads, model.trainable_variables)
  np.testing.assert_allclose(stats["norms"], ref["norms"], rtol=1e-5)
