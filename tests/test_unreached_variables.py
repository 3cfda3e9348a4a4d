"""Variables the loss does not reach (an output head it leaves out) are left alone, as in Keras.

Keras' `fit` drops a None gradient before the optimizer: such a variable gets no weight decay and
no slot update. microstep accumulates zeros for it but must not hand it to the optimizer either.
Reference: `helpers.reference_run`, plain `optimizer.apply_gradients` on the whole batch of each
update, which filters the None gradients exactly as `fit` does. AdamW with weight decay makes the
difference plain: a decayed head moves by lr x wd x w (about 1e-4) per update.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import example_tasks
import helpers
from trainer import errors
from trainer.tasks import batch_losses

ADAMW = {"optimizer.name": "adamw", "optimizer.weight_decay": 0.05,
         "optimizer.learning_rate": 0.01, "optimizer.global_clipnorm": 0.5, "train_steps": 3}


def _check_against_keras(config, tmp_path, task, unreached):
  strategy, trainer = helpers.build(config, tmp_path, task)
  initial, _ = helpers.snapshot(strategy, trainer)
  trainer.train(tf.constant(3))
  weights, slots = helpers.snapshot(strategy, trainer)
  assert int(trainer.optimizer.iterations.numpy()) == 3
  names = [v.path for v in trainer.model.trainable_variables]
  assert [names[i] for i, r in enumerate(trainer.reached.reached) if not r] == unreached
  for i, name in enumerate(names):
    if name in unreached:  # Not even a rounding step away from where it started.
      np.testing.assert_array_equal(weights[i], initial[i], err_msg=name)
    else:
      assert np.max(np.abs(weights[i] - initial[i])) > 1e-3, name
  ref_weights, ref_slots = helpers.reference_run(
      config, initial, helpers.update_batches(config, 3, task), task)
  assert helpers.max_abs_diff(weights, ref_weights) <= 1e-6
  assert helpers.max_abs_diff(slots, ref_slots) <= 1e-6
  return trainer


@pytest.mark.parametrize("strategy,steps,statistics,xla", [
    ("default", 2, 0, "off"),   # backward of the plain tape
    ("default", 2, 0, "on"),    # ... inside XLA-compiled micro-steps and update
    ("mirrored", 2, 0, "off"),
    ("default", 1, 1, "off"),   # statistics on every update: the recorded terms ARE the grads
    ("mirrored", 2, 2, "off"),  # statistics on some updates: one backward for both
])
def test_an_unused_head_is_not_decayed_as_in_keras(tmp_path, strategy, steps, statistics, xla):
  overrides = dict(ADAMW, **{"accumulation.steps": steps, "per_example.every_steps": statistics,
                             "xla": xla})
  if strategy == "mirrored":
    overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
  config = helpers.tiny_config(**overrides)
  task = example_tasks.UnusedHead(config)
  trainer = _check_against_keras(config, tmp_path, task,
                                 ["unused_head/kernel", "unused_head/bias"])
  assert trainer.gradients_from_statistics_traced == (statistics == 1)


class _ContrastiveWithUnusedHead(batch_losses.ContrastivePairs):
  """The contrastive task on an embedder with a second head that `represent` leaves out."""

  def build_model(self):
    embedder = super().build_model()
    extra = keras.layers.Dense(3, name="unused_head")
    inputs = keras.Input(embedder.input_shape[1:])
    embedding = embedder(inputs)
    return keras.Model(inputs, [embedding, extra(embedding)])

  def represent(self, model, batch, training):
    return {"a": tf.cast(model(batch["image"], training=training)[0], tf.float32),
            "b": tf.cast(model(batch["view"], training=training)[0], tf.float32)}


def test_gradcache_leaves_an_unused_head_alone(tmp_path):
  config = helpers.tiny_config(**dict(ADAMW, **{
      "task": "contrastive_pairs", "accumulation.mode": "gradcache", "accumulation.steps": 4,
      "optimizer.global_clipnorm": 0.005, "triplet.embedding_dim": 8}))
  task = _ContrastiveWithUnusedHead(config)
  _check_against_keras(config, tmp_path, task, ["unused_head/kernel", "unused_head/bias"])


def test_a_loss_that_reaches_no_variable_is_one_clear_error(tmp_path):
  config = helpers.tiny_config()
  _, trainer = helpers.build(config, tmp_path, example_tasks.ConstantLoss(config))
  with pytest.raises(errors.TaskError, match="ConstantLoss.per_example_loss reaches no trainable variable of the model") as error:
    trainer.train(tf.constant(1))
  assert "\n" not in str(error.value).strip()
