"""What the per-example path reports beside its numbers (found 2026-12-03, docs/known_issues.md
items 12 and 13): an example weighted 0 reports 0 on every variable, and a failed vectorization
is one warning, not pages of TensorFlow errors.
"""
import logging

import keras
import numpy as np
import tensorflow as tf

import per_example_helpers as h
from trainer import per_example
from trainer.per_example import per_example_gradients
from trainer.per_example import Recorder

L = keras.layers


def test_an_example_scaled_by_zero_reports_zero_on_general_path_variables_too():
  """`example_scale` c_i = 0 gave 0 on the direct variables but |grad loss_i|^2 on the general
  path ones (a silent partial norm; found 2026-12-03)."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((5,)), L.Dense(4, activation="tanh"), h.Scale(),
                            L.Dense(3)])
  x = tf.constant(np.random.default_rng(0).normal(size=(4, 5)), tf.float32)
  y = tf.constant([0, 1, 2, 0])
  scale = tf.constant([1.0, 0.0, 0.5, 2.0])

  def loss_fn(m, batch):
    return keras.losses.sparse_categorical_crossentropy(batch[1], m(batch[0]), from_logits=True)

  recorder = Recorder(model)
  assert [v.name for v in recorder.general_variables] == ["scale"]

  @tf.function
  def step(batch):
    with tf.GradientTape() as tape:
      with recorder.record(tape, batch) as rec:
        losses = loss_fn(model, batch)
      loss = tf.reduce_sum(losses * scale)
    grads, dzs = tape.gradient(loss, (model.trainable_variables, rec.outputs))
    terms = per_example.ghost_norms(rec, dzs, example_scale=scale,
                                    general_grads=recorder.general_gradients(loss_fn, batch))
    return terms.sq_norms, terms.dots(grads)

  sq_norms, dots = step((x, y))
  assert np.all(sq_norms.numpy()[1] == 0) and dots.numpy()[1] == 0
  assert np.all(sq_norms.numpy()[[0, 2, 3]] > 0)


def test_a_failed_vectorization_is_one_warning_not_pages_of_tensorflow_errors(caplog):
  """pfor logged ~130 lines at ERROR per call for a masked LSTM before the loop ran (found
  2026-12-03); now the one warning says it, and the loop's answer is the loop's."""
  keras.utils.set_random_seed(0)
  ids = keras.Input((5,), dtype="int32")
  hidden = L.LSTM(3)(L.Embedding(20, 4, mask_zero=True)(ids))
  model = keras.Model(ids, L.Dense(3)(hidden))
  batch = (tf.constant([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0], [6, 7, 8, 9, 1], [2, 0, 0, 0, 0]]),
           tf.constant([0, 1, 2, 1]))
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  tf.get_logger().addHandler(handler)
  try:
    grads = per_example_gradients(model, h.xent, batch, general_path="vectorized_map")
    again = per_example_gradients(model, h.xent, batch, general_path="vectorized_map")
  finally:
    tf.get_logger().removeHandler(handler)
  assert caplog.text.count("could not vectorize the general path") == 1  # Not per trace.
  assert not [r for r in records if r.levelno >= logging.ERROR], records[:1]
  h.assert_close_rel(again, grads, 1e-6, "masked lstm, second call")
  h.assert_close_rel(grads, h.loop_grads(model, h.xent, batch, model.trainable_variables), 1e-5,
                     "masked lstm")
