"""Per-example gradients against the loop of single-example GradientTapes (float32, CPU).

Tolerances (oracle and relative scale: tests/per_example_helpers.py):
* per-example grads vs the loop: <= 1e-5 relative, per variable over the whole [B, ...] tensor.
* sum of per-example grads vs the batch gradient of sum(losses): max|sum - G| <= 1e-6 *
  max_k(sum_i |g_i[k]|), i.e. relative to the magnitude float32 rounding in a B-term sum scales
  with; floored at 0.1 x that magnitude's largest value over all variables (near-zero gradients
  such as the attention key bias: pure rounding noise).
Every model of MODELS and both acceptance models must take the direct path for every variable
(checked before anything runs: a general-path forward through MultiHeadAttention under
`tf.vectorized_map` would kill the process with oneDNN on). The crash check itself runs in a
subprocess (`per_example_worker.py`).
"""
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import example_tasks
import per_example_helpers as h
from trainer.per_example import Recorder
from trainer.per_example import ghost_statistics
from trainer.per_example import per_example_gradients
from trainer.per_example import replica_statistics

L = keras.layers
_xent = h.xent
_loop_grads = h.loop_grads
_assert_close_rel = h.assert_close_rel
HERE = os.path.dirname(os.path.abspath(__file__))


def _image_model(make_layer, shape=(9, 9, 2)):
  keras.utils.set_random_seed(1)
  return keras.Sequential([keras.Input(shape), make_layer(), L.Flatten(), L.Dense(3)])


MODELS = {
    "dense": lambda: keras.Sequential(
        [keras.Input((5,)), L.Dense(4, activation="tanh"), L.Dense(3)]),
    "dense_rank3": lambda: keras.Sequential(
        [keras.Input((3, 5)), L.Dense(4, activation="relu"), L.Flatten(), L.Dense(3)]),
    "conv_same": lambda: _image_model(lambda: L.Conv2D(3, 3, padding="same", activation="relu")),
    "conv_valid_s2": lambda: _image_model(lambda: L.Conv2D(3, 3, strides=2, padding="valid")),
    "conv_same_s2": lambda: _image_model(
        lambda: L.Conv2D(3, (3, 2), strides=2, padding="same"), shape=(8, 9, 2)),
    "conv_wide_s2": lambda: _image_model(  # Cin > 4: per-offset matmul layout.
        lambda: L.Conv2D(3, 3, strides=2, padding="same"), shape=(7, 7, 6)),
    "conv_dil2_same": lambda: _image_model(lambda: L.Conv2D(3, 3, dilation_rate=2, padding="same")),
    "conv_dil2_valid": lambda: _image_model(lambda: L.Conv2D(3, 3, dilation_rate=2)),
    "depthwise": lambda: _image_model(
        lambda: L.DepthwiseConv2D(3, depth_multiplier=2, padding="same", activation="relu")),
    "depthwise_s2": lambda: _image_model(lambda: L.DepthwiseConv2D(3, strides=2)),
    "embedding": lambda: keras.Sequential(
        [keras.Input((4,), dtype="int32"), L.Embedding(10, 3), L.Flatten(), L.Dense(3)]),
    "layernorm": lambda: keras.Sequential(
        [keras.Input((5,)), L.Dense(4), L.LayerNormalization(), L.Dense(3)]),
    "mha": lambda: _mha_model(),
    "einsum_bias_mid": lambda: keras.Sequential(
        [keras.Input((4, 6)),
         L.EinsumDense("abc,cde->abde", output_shape=(4, 2, 3), bias_axes="d", activation="relu"),
         L.Flatten(), L.Dense(3)]),
    "einsum_elementwise": lambda: keras.Sequential(  # Kernel letter shared with in/out: einsum.
        [keras.Input((4, 6)), L.EinsumDense("abc,bc->abc", output_shape=(4, 6)),
         L.Flatten(), L.Dense(3)]),
    "dense_rank4": lambda: keras.Sequential(
        [keras.Input((2, 3, 5)), L.Dense(4, activation="relu"), L.Flatten(), L.Dense(3)]),
    "layernorm_two_axes": lambda: keras.Sequential(
        [keras.Input((3, 4)), L.Dense(4), L.LayerNormalization(axis=[1, 2]), L.Flatten(),
         L.Dense(3)]),
    "groupnorm": lambda: _image_model(lambda: L.GroupNormalization(groups=2), shape=(5, 5, 4)),
    "unitnorm": lambda: keras.Sequential(
        [keras.Input((5,)), L.Dense(4), L.UnitNormalization(), L.Dense(3)]),
    "conv1d_causal_dil2": lambda: keras.Sequential(
        [keras.Input((9, 3)), L.Conv1D(4, 3, padding="causal", dilation_rate=2,
                                       activation="relu"), L.Flatten(), L.Dense(3)]),
    "conv1d_same_s2": lambda: keras.Sequential(
        [keras.Input((9, 3)), L.Conv1D(4, 3, strides=2, padding="same"), L.Flatten(),
         L.Dense(3)]),
    "conv3d_same_s2": lambda: keras.Sequential(
        [keras.Input((4, 5, 4, 2)), L.Conv3D(3, (2, 3, 2), strides=(1, 2, 1), padding="same"),
         L.Flatten(), L.Dense(3)]),
    "conv2d_transpose_same_s2": lambda: _image_model(
        lambda: L.Conv2DTranspose(3, 3, strides=2, padding="same", activation="relu"),
        shape=(4, 5, 2)),
    "conv2d_transpose_valid_dil2": lambda: _image_model(
        lambda: L.Conv2DTranspose(3, 3, dilation_rate=2, activation="relu"), shape=(4, 5, 6)),
    "conv1d_transpose_valid_s2": lambda: keras.Sequential(
        [keras.Input((5, 3)), L.Conv1DTranspose(2, 3, strides=2), L.Flatten(), L.Dense(3)]),
    "separable2d_s2": lambda: _image_model(
        lambda: L.SeparableConv2D(4, 3, strides=2, padding="same", depth_multiplier=2,
                                  activation="relu")),
    "separable1d": lambda: keras.Sequential(
        [keras.Input((9, 3)), L.SeparableConv1D(4, 3, padding="same"), L.Flatten(),
         L.Dense(3)]),
    "depthwise1d_s2": lambda: keras.Sequential(
        [keras.Input((9, 3)), L.DepthwiseConv1D(3, depth_multiplier=2, strides=2), L.Flatten(),
         L.Dense(3)]),
    "dense_called_twice": lambda: _shared_dense_model(),
}


def _shared_dense_model():
  keras.utils.set_random_seed(1)
  inputs = keras.Input((5,))
  shared = L.Dense(5, activation="tanh")
  return keras.Model(inputs, L.Dense(3)(shared(shared(inputs))))


def _mha_model():
  keras.utils.set_random_seed(1)
  inputs = keras.Input((4, 6))
  h = L.MultiHeadAttention(num_heads=2, key_dim=3)(inputs, inputs)
  return keras.Model(inputs, L.Dense(3)(L.Flatten()(h)))


_batch_for = h.batch_for


def _check_against_loop_and_batch_gradient(model, batch, what):
  variables = model.trainable_variables
  assert not Recorder(model).general_variables, f"{what}: every variable must be direct"
  ours = per_example_gradients(model, _xent, batch)
  _assert_close_rel(ours, _loop_grads(model, _xent, batch, variables), 1e-5, what)

  with tf.GradientTape() as tape:
    total = tf.reduce_sum(_xent(model, batch))
  batch_grads = tape.gradient(total, variables)
  magnitudes = [np.max(np.sum(np.abs(g), axis=0)) for g in ours]
  floor = 0.1 * float(max(magnitudes))
  for k, (g, ref) in enumerate(zip(ours, batch_grads)):
    ref = tf.convert_to_tensor(ref).numpy()
    scale = max(float(magnitudes[k]), floor, 1e-12)
    err = float(np.max(np.abs(np.sum(g, axis=0) - ref)))
    assert err <= 1e-6 * scale, f"{what} var {k}: sum err {err:.3g} > 1e-6 * {scale:.3g}"


@pytest.mark.parametrize("size", [1, 7, 64])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_single_example_loop_and_sums_to_batch_gradient(name, size):
  keras.utils.set_random_seed(1)
  model = MODELS[name]()
  _check_against_loop_and_batch_gradient(model, _batch_for(model, size), name)


def test_mixed_float16_layers_get_their_terms_and_match_the_loop():
  # Inside a layer's call under a mixed policy the layer's variables read as float16 casts;
  # their terms must still be registered (they were silently dropped: zero gradients).
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((6, 6, 2)), L.Conv2D(4, 3, activation="relu"), L.Flatten(),
        L.Dense(8, activation="relu"), L.LayerNormalization(), L.Dense(3, dtype="float32")])
    batch = _batch_for(model, 5)
    ours = per_example_gradients(model, _xent, batch)
    ref = _loop_grads(model, _xent, batch, model.trainable_variables)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  assert all(float(np.max(np.abs(r))) > 0 for r in ref)
  _assert_close_rel([tf.cast(g, tf.float32) for g in ours], ref, 3e-3, "mixed_float16")


@pytest.mark.parametrize("size", [1, 7, 64])
def test_text_transformer_direct_matches_loop_and_sums_to_batch_gradient(size):
  # Embedding(1000, 32) -> MultiHeadAttention + LayerNormalization -> Dense -> pooling -> Dense(2)
  model = h.text_transformer()
  rng = np.random.default_rng(size)
  ids = tf.constant(rng.integers(0, 40, size=(size, 16)), tf.int32)  # Repeated ids.
  labels = tf.constant(rng.integers(0, 2, size=size), tf.int32)
  _check_against_loop_and_batch_gradient(model, (ids, labels), "text_transformer")


@pytest.mark.parametrize("size", [1, 7, 64])
def test_conv_mix_direct_matches_loop_and_sums_to_batch_gradient(size):
  model = h.conv_mix()
  _check_against_loop_and_batch_gradient(model, _batch_for(model, size), "conv_mix")


def test_transformer_b64_default_path_and_loop_path_survive_onednn_in_subprocess():
  # The old general path killed the process here (SIGSEGV, exit 139 / -11): run it apart.
  # oneDNN on, as TF's default on CPUs with AVX512-VNNI (set here too, whatever the host's default).
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="0",
             PYTHONPATH=os.path.dirname(HERE))
  done = subprocess.run([sys.executable, os.path.join(HERE, "per_example_worker.py")],
                        capture_output=True, text=True, env=env, timeout=600, check=False)
  assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
  assert "oneDNN custom operations are on" in done.stderr
  errors = dict(line.split()[1:] for line in done.stdout.splitlines()
                if line.startswith("ERROR "))
  assert set(errors) == {"default_b64", "loop_b8"}, done.stdout
  for what, err in errors.items():
    assert float(err) <= 1e-5, (what, err)


def _scaled_dense_model():
  keras.utils.set_random_seed(1)
  return keras.Sequential([keras.Input((5,)), L.Dense(4, activation="tanh"), h.Scale(),
                           L.Dense(3)])


@pytest.mark.parametrize("general_path", ["vectorized_map", "loop"])
def test_general_path_matches_loop_eager_and_traced(general_path):
  model = _scaled_dense_model()
  recorder = Recorder(model)
  assert recorder.general_variables == [model.layers[1].scale]
  batch = _batch_for(model, 6)
  ref = _loop_grads(model, _xent, batch, model.trainable_variables)
  fn = lambda b: per_example_gradients(model, _xent, b, general_path=general_path)
  _assert_close_rel(fn(batch), ref, 1e-5, f"{general_path} eager")
  _assert_close_rel(tf.function(fn)(batch), ref, 1e-5, f"{general_path} traced")


def test_general_path_loop_is_a_compiled_while_loop_without_pfor():
  model = _scaled_dense_model()
  batch = _batch_for(model, 5)
  graph = tf.function(lambda b: per_example_gradients(model, _xent, b, general_path="loop")
                      ).get_concrete_function(batch).graph
  types = {op.type for op in graph.get_operations()}
  assert "While" in types or "StatelessWhile" in types, types
  assert not any("pfor" in op.name for op in graph.get_operations())


def test_general_path_error_refuses_in_one_line_naming_variable_and_layer():
  model = _scaled_dense_model()
  batch = _batch_for(model, 4)
  with pytest.raises(ValueError) as info:
    per_example_gradients(model, _xent, batch, general_path="error")
  message = str(info.value)
  assert "\n" not in message
  assert "general_path='error'" in message
  scale = model.layers[1]
  assert f"{scale.scale.path} (Scale '{scale.name}': no direct formula for Scale)" in message
  # Direct-only models pass with `error`.
  dense = MODELS["dense"]()
  _assert_close_rel(per_example_gradients(dense, _xent, _batch_for(dense, 4), general_path="error"),
                    _loop_grads(dense, _xent, _batch_for(dense, 4), dense.trainable_variables),
                    1e-5, "error path, direct model")
  with pytest.raises(ValueError, match="`general_path` must be one of"):
    per_example_gradients(dense, _xent, batch, general_path="pfor")


def test_traced_chunked_equals_unchunked_mixed_paths():
  model = _scaled_dense_model()  # Dense (direct) + Scale (general).
  batch = _batch_for(model, 7)
  eager = per_example_gradients(model, _xent, batch)
  traced = tf.function(lambda b: per_example_gradients(model, _xent, b))(batch)
  chunked = per_example_gradients(model, _xent, batch, chunk_size=3)  # 3 + 3 + 1
  traced_chunked = tf.function(
      lambda b: per_example_gradients(model, _xent, b, chunk_size=2))(batch)
  for result in (traced, chunked, traced_chunked):
    _assert_close_rel(result, [g.numpy() for g in eager], 1e-6, "chunked/traced")


def test_direct_path_is_vectorized_without_filter_backprop():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((12, 12, 1)), L.Conv2D(4, 3, activation="relu"),
                            L.MaxPooling2D(), L.Flatten(), L.Dense(5)])
  batch = _batch_for(model, 4)
  fn = tf.function(lambda b: per_example_gradients(model, _xent, b))
  types = {op.type for op in fn.get_concrete_function(batch).graph.get_operations()}
  assert not types & {"While", "StatelessWhile", "Conv2DBackpropFilter"}, types


def test_explicit_variable_subset_and_plain_module():
  model = MODELS["conv_same"]()
  batch = _batch_for(model, 5)
  subset = [model.trainable_variables[0], model.trainable_variables[3]]
  ours = per_example_gradients(model, _xent, batch, variables=subset)
  _assert_close_rel(ours, _loop_grads(model, _xent, batch, subset), 1e-5, "subset")

  class Linear(tf.Module):

    def __init__(self):
      super().__init__()
      self.w = tf.Variable(tf.random.normal([5, 3], seed=3))

    def __call__(self, x, training=False):
      return x @ self.w

  linear = Linear()
  batch = _batch_for(MODELS["dense"](), 6)
  ours = per_example_gradients(linear, _xent, batch)
  _assert_close_rel(ours, _loop_grads(linear, _xent, batch, [linear.w]), 1e-5, "tf.Module")


def test_batchnorm_in_training_mode_is_refused():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((5,)), L.Dense(4), L.BatchNormalization(), L.Dense(3)])
  batch = _batch_for(model, 6)
  with pytest.raises(ValueError, match="BatchNormalization.*training=True") as info:
    per_example_gradients(model, _xent, batch)
  assert str(info.value).startswith("per_example: ") and "\n" not in str(info.value)
  # A functional graph built with BN(training=False) still runs it with the model call's
  # training=True (Keras 3 passes the outer flag down): refused, and the advice says what works.
  inputs = keras.Input((5,))
  hidden = L.BatchNormalization()(L.Dense(4)(inputs), training=False)
  functional = keras.Model(inputs, L.Dense(3)(hidden))
  with pytest.raises(ValueError, match="set layer.trainable=False, call it with training=False "
                                       r"\(inside a functional model"):
    per_example_gradients(functional, _xent, _batch_for(functional, 6))
  # General path too (Scale + BN): refused while tracing the vectorized function.
  emb = keras.Sequential([keras.Input((5,)), h.Scale(), L.BatchNormalization(), L.Dense(3)])
  with pytest.raises(ValueError, match="BatchNormalization"):
    per_example_gradients(emb, _xent, _batch_for(emb, 6))
  # Inference-mode BN is per-example: allowed and exact.
  inference = lambda m, b: keras.losses.sparse_categorical_crossentropy(
      b[1], m(b[0], training=False), from_logits=True)
  ours = per_example_gradients(model, inference, batch)
  _assert_close_rel(ours, _loop_grads(model, inference, batch, model.trainable_variables),
                    1e-5, "bn inference")


class _DenseCell(L.Layer):
  """An RNN cell built from Dense sublayers (called inside the RNN's tf.while_loop)."""

  def __init__(self, units, **kwargs):
    super().__init__(**kwargs)
    self.units, self.state_size = units, units
    self.inp, self.rec = L.Dense(units), L.Dense(units, use_bias=False)

  def build(self, shape):
    self.inp.build(shape)
    self.rec.build((shape[0], self.units))

  def call(self, x, states):
    h = tf.tanh(self.inp(x) + self.rec(states[0]))
    return h, [h]


def test_layers_inside_a_recurrent_loop_take_the_general_path_and_time_distributed_does_not():
  # The RNN calls its cell's Dense layers in a tf.while_loop: general path. TimeDistributed over
  # a static number of steps calls its Dense in a Python loop: recorded, direct path.
  keras.utils.set_random_seed(1)
  inputs = keras.Input((5, 4))
  rnn, per_step = L.RNN(_DenseCell(3)), L.TimeDistributed(L.Dense(2))
  model = keras.Model(inputs, L.Dense(3)(L.Concatenate()([rnn(inputs),
                                                          L.Flatten()(per_step(inputs))])))
  recorder = Recorder(model)
  assert {id(v) for v in recorder.general_variables} == {id(v) for v in rnn.trainable_variables}
  with pytest.raises(ValueError, match="called in a loop by RNN"):
    Recorder(model, general_path="error")
  unrolled = keras.Model(inputs, L.Dense(3)(L.RNN(_DenseCell(3), unroll=True)(inputs)))
  assert not Recorder(unrolled).general_variables
  for m, name in ((model, "rnn/time-distributed"), (unrolled, "unrolled rnn")):
    batch = _batch_for(m, 4)
    traced = tf.function(lambda b, m=m: per_example_gradients(m, _xent, b))(batch)
    _assert_close_rel(traced, _loop_grads(m, _xent, batch, m.trainable_variables), 1e-5, name)


def test_a_covered_layer_called_inside_a_nested_loop_is_refused_in_one_line():
  keras.utils.set_random_seed(1)
  model = keras.Sequential([keras.Input((12,)), example_tasks.PerStepDense(), L.Dense(3)])
  batch = _batch_for(model, 4)
  with pytest.raises(ValueError) as info:
    tf.function(lambda b: per_example_gradients(model, _xent, b), autograph=False)(batch)
  message = str(info.value)
  assert message.startswith("per_example: Dense '"), message
  assert "nested function or loop" in message and "\n" not in message, message
  # Raised after the forward, not inside tf.map_fn (which then leaves a caching device on the
  # variable scope and every later `strategy.scope()` fails).
  with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    tf.Variable(1.0)
  # Eagerly the map_fn runs as a Python loop: the same layer is recorded once per step.
  _assert_close_rel(per_example_gradients(model, _xent, batch),
                    _loop_grads(model, _xent, batch, model.trainable_variables), 1e-5, "eager")


class _MappedDense(L.Layer):
  """A Dense applied to each time step by tf.vectorized_map: traced, pfor builds the map's body
  in the caller's graph (not in a nested one) and then rewrites it."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = L.Dense(2)

  def build(self, shape):
    self.dense.build((None, shape[-1]))

  def call(self, x):
    return tf.transpose(tf.vectorized_map(self.dense, tf.transpose(x, [1, 0, 2])), [1, 0, 2])


def test_a_covered_layer_inside_a_traced_vectorized_map_is_refused_not_given_zeros():
  # Both gave the mapped Dense all-zero per-example gradients, with no error, when traced.
  keras.utils.set_random_seed(1)
  inputs = keras.Input((None, 4))
  mapped = keras.Model(inputs, L.Dense(3)(L.GlobalAveragePooling1D()(_MappedDense()(inputs))))
  # Keras' TimeDistributed over an unknown number of steps maps with vectorized_map.
  per_step = keras.Model(inputs, L.Dense(3)(L.GlobalAveragePooling1D()(
      L.TimeDistributed(L.Dense(2))(inputs))))
  spec = [(tf.TensorSpec([None, None, 4]), tf.TensorSpec([None], tf.int32))]
  rng = np.random.default_rng(0)
  batch = (tf.constant(rng.normal(size=(5, 5, 4)), tf.float32), tf.constant([0, 1, 2, 1, 0]))
  for model in (mapped, per_step):
    traced = tf.function(lambda b, m=model: per_example_gradients(m, _xent, b),
                         input_signature=spec)
    with pytest.raises(ValueError, match=r"^per_example: Dense '.*nested function or loop"):
      traced(batch)


def test_vectorized_map_that_pfor_cannot_convert_runs_the_loop_instead(caplog):
  # An LSTM over a masked Embedding: pfor raises while converting (a TensorList `variant`).
  keras.utils.set_random_seed(1)
  ids = keras.Input((6,), dtype="int32")
  model = keras.Model(ids, L.Dense(3)(L.LSTM(3)(L.Embedding(10, 4, mask_zero=True)(ids))))
  batch = (tf.constant([[1, 2, 3, 0, 0, 0], [4, 5, 0, 0, 0, 0], [1, 1, 1, 1, 1, 2],
                        [7, 0, 0, 0, 0, 0]]), tf.constant([0, 1, 2, 1]))
  with caplog.at_level("WARNING"):  # Traced (eagerly the attempt is traced the same way).
    traced = tf.function(lambda b: per_example_gradients(model, _xent, b))(batch)
  assert "ran general_path='loop' instead" in caplog.text
  _assert_close_rel(traced, _loop_grads(model, _xent, batch, model.trainable_variables), 1e-5,
                    "fallback")


def test_an_error_of_the_users_loss_on_the_general_path_is_raised_not_retried_as_a_loop(caplog):
  model = _scaled_dense_model()  # Its Scale layer takes the general path.
  batch = _batch_for(model, 4)

  def fails_on_one_example(m, b):  # The general path calls the loss on batches of one.
    if b[0].shape[0] == 1:
      raise ValueError("the user's loss failed")
    return _xent(m, b)

  with caplog.at_level("WARNING"), pytest.raises(ValueError, match="the user's loss failed"):
    tf.function(lambda b: per_example_gradients(model, fails_on_one_example, b))(batch)
  assert "general_path='loop'" not in caplog.text


def test_dropout_with_seed_sums_to_batch_gradient_of_same_forward():
  keras.utils.set_random_seed(0)
  dropout = L.Dropout(0.5, seed=7)
  model = keras.Sequential([keras.Input((6,)), L.Dense(16), dropout,
                            L.Dense(3)])
  batch = _batch_for(model, 32)
  state = dropout.seed_generator.state.numpy()
  ours = per_example_gradients(model, _xent, batch)
  dropout.seed_generator.state.assign(state)  # Replay the same masks.
  with tf.GradientTape() as tape:
    total = tf.reduce_sum(_xent(model, batch))
  batch_grads = tape.gradient(total, model.trainable_variables)
  for g, ref in zip(ours, batch_grads):
    np.testing.assert_allclose(np.sum(g, axis=0), ref.numpy(), rtol=1e-5, atol=1e-6)
  # The mask really acts: about half of the hidden units get zero gradient per example.
  zero_share = float(np.mean(ours[2] == 0))  # Dense(3) kernel rows of dropped units.
  assert 0.3 < zero_share < 0.7, zero_share


def test_argument_errors():
  model = MODELS["dense"]()
  batch = _batch_for(model, 3)
  with pytest.raises(ValueError, match="chunk_size"):
    per_example_gradients(model, _xent, batch, chunk_size=-1)
  with pytest.raises(ValueError, match="loss_fn must return per-example losses"):
    per_example_gradients(model, lambda m, b: tf.reduce_sum(_xent(m, b)), batch)


def test_loss_fn_with_tensor_control_flow_is_autographed_when_the_caller_is():
  # The library traces without AutoGraph; the user's loss_fn is still converted when called
  # from an AutoGraph tf.function, as it would have been without the library in between.
  model = _scaled_dense_model()
  batch = _batch_for(model, 5)

  def loss_fn(m, b):
    losses = _xent(m, b)
    if tf.reduce_sum(losses) > 0.0:  # A tensor condition: needs AutoGraph inside tf.function.
      losses = 2.0 * losses
    return losses

  ref = [2.0 * g for g in _loop_grads(model, _xent, batch, model.trainable_variables)]
  for path in ("vectorized_map", "loop"):
    traced = tf.function(lambda b, path=path: per_example_gradients(
        model, loss_fn, b, general_path=path))(batch)
    _assert_close_rel(traced, ref, 1e-5, f"autographed loss_fn, {path}")
  with pytest.raises(TypeError, match="tf.Tensor. as a Python .bool."):
    tf.function(lambda b: per_example_gradients(model, loss_fn, b), autograph=False)(batch)


def test_a_model_without_trainable_variables_is_refused_in_one_line():
  # Unbuilt (no Input, never called) and frozen models used to fail deep inside TensorFlow
  # (a ConcatV2 of no tensors) or return an empty list.
  unbuilt = keras.Sequential([L.Dense(4), L.Dense(3)])
  frozen = MODELS["dense"]()
  frozen.trainable = False
  batch = _batch_for(MODELS["dense"](), 4)
  for model in (unbuilt, frozen):
    for call in (lambda m: per_example_gradients(m, _xent, batch),
                 lambda m: ghost_statistics(m, _xent, batch),
                 lambda m: tf.function(lambda b: ghost_statistics(m, _xent, b),
                                       autograph=False)(batch)):  # AutoGraph adds its frames.
      with pytest.raises(ValueError, match=r"^per_example: the model has no trainable variables; "
                                           r"build it first") as info:
        call(model)
      assert "\n" not in str(info.value)
  with pytest.raises(ValueError, match=r"^per_example: `variables` is empty"):
    per_example_gradients(MODELS["dense"](), _xent, batch, variables=[])
  with pytest.raises(ValueError, match=r"^replica_statistics: `variables` is empty"):
    replica_statistics([], [])
