"""Keras 3 models of the built-in tasks (small CNN, MLP, VGG bodies, text Transformer) and
their shared classification loss.

Built eagerly under the strategy scope (so variables are mirrored). `dtype` is the Keras dtype
policy name from `config.mixed_precision`; heads always compute in float32.
"""
import keras
import tensorflow as tf

from trainer import base_task

MODELS = ("small_cnn", "small_cnn_bn", "mlp", "vgg16", "vgg_small")
# Smallest square input side each model accepts (convolutions and poolings must leave >= 1 pixel).
SMALLEST_INPUT = {"small_cnn": 10, "small_cnn_bn": 10, "mlp": 1, "vgg16": 32, "vgg_small": 32}

# VGG-16 configuration "D": conv widths, "M" = 2x2 max-pool.
_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def _vgg_body(width_divisor: int, dtype: str) -> list:
  layers = []
  for item in _VGG16:
    if item == "M":
      layers.append(keras.layers.MaxPooling2D(2, dtype=dtype))
    else:
      layers.append(keras.layers.Conv2D(max(item // width_divisor, 4), 3, padding="same",
                                        activation="relu", dtype=dtype))
  return layers


def body_layers(name: str, dtype: str) -> list:
  """Returns the feature layers of model `name` (no input, no head)."""
  if name in ("small_cnn", "small_cnn_bn"):
    bn = name == "small_cnn_bn"
    layers = [keras.layers.Conv2D(32, 3, activation=None if bn else "relu", dtype=dtype)]
    if bn:
      layers += [keras.layers.BatchNormalization(dtype=dtype), keras.layers.ReLU(dtype=dtype)]
    layers += [keras.layers.MaxPooling2D(2, dtype=dtype),
               keras.layers.Conv2D(64, 3, activation="relu", dtype=dtype),
               keras.layers.MaxPooling2D(2, dtype=dtype),
               keras.layers.Flatten(dtype=dtype),
               keras.layers.Dense(128, activation="relu", dtype=dtype)]
    return layers
  if name == "mlp":
    return [keras.layers.Flatten(dtype=dtype), keras.layers.Dense(64, activation="relu", dtype=dtype)]
  if name == "vgg16":
    return _vgg_body(1, dtype) + [keras.layers.Flatten(dtype=dtype)]
  if name == "vgg_small":
    return _vgg_body(8, dtype) + [keras.layers.Flatten(dtype=dtype)]
  raise ValueError(f"`model`={name!r} unknown; allowed: {', '.join(MODELS)}")


def classifier(name: str, input_shape, num_classes: int, dtype: str = "float32") -> keras.Model:
  """Body plus a float32 logits head."""
  layers = ([keras.Input(input_shape)] + body_layers(name, dtype)
            + [keras.layers.Dense(num_classes, dtype="float32", name="logits")])
  return keras.Sequential(layers, name=name)


def embedder(name: str, input_shape, embedding_dim: int, dtype: str = "float32") -> keras.Model:
  """Body plus a float32 linear projection to a unit-norm embedding (triplet networks)."""
  layers = ([keras.Input(input_shape)] + body_layers(name, dtype)
            + [keras.layers.Dense(embedding_dim, dtype="float32", name="embedding"),
               keras.layers.UnitNormalization(dtype="float32")])
  return keras.Sequential(layers, name=f"{name}_embedder")


def text_transformer(vocab_size: int, sequence_length: int, num_classes: int, *,
                     embedding_dim: int = 32, num_heads: int = 2, key_dim: int = 16,
                     dtype: str = "float32") -> keras.Model:
  """Embedding -> MultiHeadAttention + residual + LayerNormalization -> Dense -> mean -> logits."""
  tokens = keras.Input((sequence_length,), dtype="int32", name="tokens")
  x = keras.layers.Embedding(vocab_size, embedding_dim, dtype=dtype)(tokens)
  attended = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=key_dim,
                                             dtype=dtype)(x, x)
  x = keras.layers.LayerNormalization(dtype=dtype)(keras.layers.Add(dtype=dtype)([x, attended]))
  x = keras.layers.Dense(embedding_dim, activation="relu", dtype=dtype)(x)
  x = keras.layers.GlobalAveragePooling1D(dtype=dtype)(x)
  logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
  return keras.Model(tokens, logits, name="text_transformer")


def softmax_classification(logits, labels) -> base_task.LossOutput:
  """Per-example softmax cross-entropy and `accuracy` of integer labels (traced)."""
  logits = tf.cast(logits, tf.float32)
  loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
  correct = tf.cast(tf.equal(tf.argmax(logits, -1), tf.cast(labels, tf.int64)), tf.float32)
  return base_task.LossOutput(loss=loss, metrics={"accuracy": correct})
