"""Subprocess for test_per_example: the text Transformer with oneDNN on (TF's default).

Runs what used to kill the process (pfor through MultiHeadAttention, SIGSEGV at B >= 2):
  default_b64  per_example_gradients of the Transformer at B=64 (all direct now);
  loop_b8      the Transformer with an extra Scale layer (no direct formula) on the general
               path `loop`, B=8.
Prints `ERROR <case> <max relative error vs the single-example loop>` per case; exit 0.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import per_example_helpers as h  # pylint: disable=g-import-not-at-top
from trainer.per_example import per_example_gradients  # pylint: disable=g-import-not-at-top


def _batch(size, seed):
  rng = np.random.default_rng(seed)
  return (tf.constant(rng.integers(0, 40, size=(size, 16)), tf.int32),
          tf.constant(rng.integers(0, 2, size=size), tf.int32))


def _scaled_transformer():
  keras.utils.set_random_seed(0)
  ids = keras.Input((16,), dtype="int32")
  x = h.Scale()(keras.layers.Embedding(1000, 32)(ids))
  x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=16)(x, x)
  return keras.Model(ids, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x)))


def main():
  for case, model, size, path in (("default_b64", h.text_transformer(), 64, "vectorized_map"),
                                  ("loop_b8", _scaled_transformer(), 8, "loop")):
    batch = _batch(size, seed=size)
    ours = per_example_gradients(model, h.xent, batch, general_path=path)
    ref = h.loop_grads(model, h.xent, batch, model.trainable_variables)
    print(f"ERROR {case} {max(h.rel_errors(ours, ref)):.3g}", flush=True)


if __name__ == "__main__":
  main()
