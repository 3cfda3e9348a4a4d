"""Per-example gradients against the loop of single-example GradientTapes (float32, CPU).

Tolerances:
* per-example grads vs the loop: max|ours - loop| <= 1e-5 * max|loop|, per variable over the
  whole [B, ...] tensor (relative to the variable's largest per-example entry, floored at 0.1 x
  the largest entry of any variable, for gradients that are exactly zero up to rounding, such as
  the attention key bias, which softmax ignores).
* sum of per-example grads vs the batch gradient of sum(losses): max|sum - G| <= 1e-6 *
  max_k(sum_i |g_i[k]|), i.e. relative to the magnitude float32 rounding in a B-term sum scales
  with (absolute 1e-6 when that magnitude is ~1); floored at 0.1 x that magnitude's largest value
  over all variables (near-zero gradients such as the attention key bias: pure rounding noise).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.per_example import per_example_gradients

L = keras.layers


def _xent(model, batch):
  x, y = batch
  logits = model(x, training=True)
  return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _loop_grads(model, loss_fn, batch, variables):
  size = tf.nest.flatten(batch)[0].shape[0]
  rows = []
  for i in range(size):
    example = tf.nest.map_structure(lambda t, i=i: t[i:i + 1], batch)
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(loss_fn(model, example))
    grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    rows.append([tf.convert_to_tensor(g).numpy() for g in grads])
  return [np.stack(col) for col in zip(*rows)]


def _assert_close_rel(ours, ref, rel, what):
  # Variables whose exact gradient is ~0 (attention key bias: softmax ignores it) hold rounding
  # noise only; their scale is floored at 0.1 x the largest entry over all variables.
  floor = 0.1 * max(float(np.max(np.abs(b))) for b in ref)
  for k, (a, b) in enumerate(zip(ours, ref)):
    a = np.asarray(a)
    assert a.shape == b.shape, f"{what} var {k}: shape {a.shape} != {b.shape}"
    scale = max(float(np.max(np.abs(b))), floor, 1e-12)
    err = float(np.max(np.abs(a - b)))
    assert err <= rel * scale, f"{what} var {k}: max err {err:.3g} > {rel} * {scale:.3g}"


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
}


def _mha_model():
  keras.utils.set_random_seed(1)
  inputs = keras.Input((4, 6))
  h = L.MultiHeadAttention(num_heads=2, key_dim=3)(inputs, inputs)
  return keras.Model(inputs, L.Dense(3)(L.Flatten()(h)))


def _batch_for(model, size, seed=0):
  rng = np.random.default_rng(seed)
  shape = (size,) + tuple(model.inputs[0].shape[1:])
  if model.inputs[0].dtype.startswith("int"):
    x = rng.integers(0, 10, size=shape).astype(np.int32)
  else:
    x = rng.normal(size=shape).astype(np.float32)
  y = rng.integers(0, 3, size=(size,)).astype(np.int32)
  return tf.constant(x), tf.constant(y)


@pytest.mark.parametrize("size", [1, 7, 64])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_single_example_loop_and_sums_to_batch_gradient(name, size):
  keras.utils.set_random_seed(1)
  model = MODELS[name]()
  batch = _batch_for(model, size)
  variables = model.trainable_variables
  ours = per_example_gradients(model, _xent, batch)
  _assert_close_rel(ours, _loop_grads(model, _xent, batch, variables), 1e-5, name)

  with tf.GradientTape() as tape:
    total = tf.reduce_sum(_xent(model, batch))
  batch_grads = tape.gradient(total, variables)
  magnitudes = [np.max(np.sum(np.abs(g), axis=0)) for g in ours]
  floor = 0.1 * float(max(magnitudes))
  for k, (g, ref) in enumerate(zip(ours, batch_grads)):
    ref = tf.convert_to_tensor(ref).numpy()
    scale = max(float(magnitudes[k]), floor, 1e-12)
    err = float(np.max(np.abs(np.sum(g, axis=0) - ref)))
    assert err <= 1e-6 * scale, f"{name} var {k}: sum err {err:.3g} > 1e-6 * {scale:.3g}"


def test_traced_chunked_equals_unchunked_mixed_paths():
  model = MODELS["layernorm"]()  # Dense (direct) + LayerNormalization (general).
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
  with pytest.raises(ValueError, match="BatchNormalization.*training=True"):
    per_example_gradients(model, _xent, batch)
  # General path too (Embedding + BN): refused while tracing the vectorized function.
  emb = keras.Sequential([keras.Input((4,), dtype="int32"), L.Embedding(10, 3), L.Flatten(),
                          L.BatchNormalization(), L.Dense(3)])
  with pytest.raises(ValueError, match="BatchNormalization"):
    per_example_gradients(emb, _xent, _batch_for(emb, 6))
  # Inference-mode BN is per-example: allowed and exact.
  inference = lambda m, b: keras.losses.sparse_categorical_crossentropy(
      b[1], m(b[0], training=False), from_logits=True)
  ours = per_example_gradients(model, inference, batch)
  _assert_close_rel(ours, _loop_grads(model, inference, batch, model.trainable_variables),
                    1e-5, "bn inference")


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
