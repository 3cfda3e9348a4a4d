"""Per-example statistics inside the trainer's own update (issue 10): when they are written, and
that they equal an oracle computed from materialised per-example gradients."""

import numpy as np
import pytest
import tensorflow as tf

import example_tasks
import helpers
from trainer import base_task
from trainer import errors
from trainer import per_example
from trainer import replica_state
from trainer.per_example import kernels


def _train_with_summaries(tmp_path, overrides, updates, task_class=None):
  """(strategy, trainer, initial weights, summaries) of `updates` updates from a fresh build;
  `task_class(config)` replaces the config's task when given."""
  config = helpers.tiny_config(**overrides)
  task = None if task_class is None else task_class(config)
  strategy, trainer = helpers.build(config, tmp_path / "w", task)
  initial, _ = helpers.snapshot(strategy, trainer)
  writer = tf.summary.create_file_writer(str(tmp_path / "tb"))
  with writer.as_default():
    trainer.train(tf.constant(updates))
  writer.flush()
  return strategy, trainer, initial, helpers.summary_events(tmp_path / "tb")


@pytest.mark.parametrize("replicas,k", [(1, 1), (2, 2)])
def test_statistics_every_n_updates(tmp_path, replicas, k):
  overrides = {"model": "small_cnn", "per_example.every_steps": 2, "accumulation.steps": k}
  if replicas == 2:
    overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
  _, trainer, _, events = _train_with_summaries(tmp_path, overrides, 5)
  for name in ("gns", "diversity", "mean_norm", "mean_cosine", "grad_norm", "trace", "norms",
               "cosines"):
    # Updates 1, 3 and 5 (counted from 1, as TensorBoard's steps of the loss and grad_norm).
    assert [step for step, _ in events[f"per_example/{name}"]] == [1, 3, 5], name
  assert all(0.0 < float(c) <= 1.0 for _, c in events["per_example/mean_cosine"])
  examples = 16 * k  # Norms and diversity cover every example of the update.
  assert all(1.0 / examples <= float(d) for _, d in events["per_example/diversity"])
  assert int(trainer.optimizer.iterations.numpy()) == 5
  assert np.isfinite(float(trainer.last_grad_norm.numpy()))


def _oracle(config, task, initial, batch, replicas, k, loss_fn=None, counted=None):
  """The statistics of update 0 from materialised per-example gradients at the initial weights
  (of the task's weighted losses, or of `loss_fn(model, batch)`); `counted` [kB] of 0 and 1
  says which examples count (weight not 0; all by default)."""
  model = task.build_model()
  for var, value in zip(model.trainable_variables, initial):
    var.assign(value)
  loss_fn = loss_fn or (lambda m, b: base_task.weighted_outputs(task, m, b, training=True)[0])
  grads = per_example.per_example_gradients(model, loss_fn, batch)
  flat = np.concatenate([np.reshape(g, (g.shape[0], -1)) for g in grads], axis=1)
  flat = flat.astype(np.float64)
  count, per_group = flat.shape[0], flat.shape[0] // (replicas * k)
  # G: the update's gradient, from a tape of the summed losses. It equals the per-example
  # gradients' sum unless the losses mix the examples (then the g_i are single-example ones).
  with tf.GradientTape() as tape:
    summed = tf.reduce_sum(loss_fn(model, batch))
  grads_sum = tape.gradient(summed, model.trainable_variables)
  total = np.concatenate([np.reshape(np.zeros(v.shape) if g is None else tf.convert_to_tensor(g),
                                     -1) for v, g in zip(model.trainable_variables, grads_sum)])
  total = total.astype(np.float64)
  counted = np.ones(count) if counted is None else np.asarray(counted, np.float64)
  rows, count = count, counted.sum()
  g2 = np.sum((total / count) ** 2)
  n2 = np.sum(flat ** 2, axis=1)
  small = np.mean([np.sum((flat[i:i + per_group].sum(0)
                           / max(counted[i:i + per_group].sum(), 1.0)) ** 2)
                   for i in range(0, rows, per_group)])
  if replicas * k == 1:
    b_small, small = 1.0, n2.sum() / count
  else:
    b_small = count / (replicas * k)
  big_g2 = (count * g2 - b_small * small) / (count - b_small)
  s = (small - g2) / (1.0 / b_small - 1.0 / count)
  last = flat[-config.batch_size:]  # Cosines: the update's last micro-batch, all replicas.
  last = last[counted[-config.batch_size:] > 0]
  cos = last @ total / (np.linalg.norm(last, axis=1) * np.linalg.norm(total))
  return {"gns": s / big_g2, "diversity": n2.sum() / np.sum(total ** 2),
          "mean_norm": np.sqrt(n2[counted > 0]).mean(),
          "trace": (n2.sum() - count * g2) / (count - 1),
          "grad_norm": np.sqrt(g2), "mean_cosine": cos.mean(), "cosines": cos,
          "norms": np.linalg.norm(last, axis=1)}


@pytest.mark.parametrize("replicas,k,model", [(1, 1, "small_cnn"), (2, 2, "mlp")])
def test_statistics_equal_the_materialised_oracle(tmp_path, replicas, k, model):
  overrides = {"model": model, "per_example.every_steps": 1, "accumulation.steps": k,
               "batch_size": 16}
  if replicas == 2:
    overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
  config = helpers.tiny_config(**overrides)
  _, trainer, initial, events = _train_with_summaries(tmp_path, overrides, 1)
  batch = helpers.update_batches(config, 1)[0]
  _assert_events_equal(events, _oracle(config, trainer.task, initial, batch, replicas, k))


class PaddingWeighsZero(example_tasks.NoMetrics):
  """About a third of the examples weigh 0, as padding rows do."""

  @staticmethod
  def weight(batch):
    return tf.cast(batch["x"][:, 1] < 0.4, tf.float32)

  def per_example_loss(self, model, batch, training):
    loss = example_tasks._xent(model, batch, training)[0]  # pylint: disable=protected-access
    return base_task.LossOutput(loss=loss, weight=self.weight(batch))


@pytest.mark.parametrize("replicas,k", [(1, 1), (2, 2)])
def test_examples_of_weight_zero_are_left_out_of_the_statistics(tmp_path, replicas, k):
  """They counted as zero gradients with cosine 0: mean_cosine 0.26 where the examples that
  count had 0.41, mean_norm 6.1 against 7.5, and a spike at 0 in the histograms (a probe,
  2026-12-07). Their g_i is 0; the oracle leaves them out of every count and mean."""
  overrides = {"per_example.every_steps": 1, "accumulation.steps": k, "batch_size": 16}
  if replicas == 2:
    overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
  config = helpers.tiny_config(**overrides)
  task = PaddingWeighsZero(config)
  _, _, initial, events = _train_with_summaries(tmp_path, overrides, 1, PaddingWeighsZero)
  batch = helpers.update_batches(config, 1, task)[0]
  counted = PaddingWeighsZero.weight(batch).numpy()
  assert 0 < counted[-16:].sum() < 16 and counted.sum() < len(counted)
  weighted = lambda model, b: (example_tasks._xent(model, b, True)[0]  # pylint: disable=protected-access
                               * PaddingWeighsZero.weight(b))
  _assert_events_equal(events, _oracle(config, task, initial, batch, replicas, k,
                                       loss_fn=weighted, counted=counted))


def _assert_events_equal(events, expected):
  for name, value in expected.items():
    (step, got), = events[f"per_example/{name}"]
    assert step == 1
    if name in ("cosines", "norms"):  # Histograms: compare the bucket limits' range.
      got_values = got  # [buckets, 3]: left edge, right edge, count.
      assert got_values[:, 2].sum() == len(value)
      np.testing.assert_allclose([got_values[0, 0], got_values[-1, 1]],
                                 [value.min(), value.max()], rtol=1e-4, atol=1e-6)
    else:
      np.testing.assert_allclose(float(got), value, rtol=1e-5, err_msg=name)


GENERAL_IN_THE_HOOK = {  # task: the variables its model must send to the general path.
    "PositionTransformer": lambda model: [model.layers[1].positions.embeddings],
    "GradientPenalty": lambda model: model.trainable_variables,
    "HardExampleWeights": lambda model: model.trainable_variables,  # The loss mixes examples.
    "CenteredBatch": lambda model: model.trainable_variables,  # So does the model.
    # Read outside their layer's call: the statistics had missed those uses (a probe's tied
    # language model: mean_norm 8% off, trace 19%, 2026-12-06).
    "TiedEmbeddings": lambda model: example_tasks.TiedEmbeddings.model_embedding(
        model).trainable_variables,
    "WeightPenaltyInLoss": lambda model: model.layers[0].trainable_variables,
    # Inference-mode BatchNormalization of a trainable layer: refused until 2026-12-06, though
    # the docs promised it works; it has no direct formula.
    "InferenceBatchNorm": lambda model: model.norm.trainable_variables,
}


@pytest.mark.parametrize("task_name", sorted(GENERAL_IN_THE_HOOK))
def test_layers_the_formulas_cannot_serve_take_the_general_path_in_the_trainer_hook(tmp_path,
                                                                                   task_name):
  """The position Embedding over arange(T) is not per example (T == 4 rows whatever B); a loss
  with an input-gradient penalty differentiates the model inside the loss. The hook must send
  those layers to the general path. Its statistics equal the oracle's and the update equals
  the one without statistics (the demoted variables' gradient comes from the tape)."""
  moved = {}
  for every in (1, 0):
    overrides = {"per_example.every_steps": every, "train_steps": 1, "batch_size": 8,
                 "optimizer.name": "sgd", "optimizer.learning_rate": 0.1}  # (Adam's first
    # step has the size of the learning rate for any nonzero gradient: rounding noise too.)
    config = helpers.tiny_config(**overrides)
    task = getattr(example_tasks, task_name)(config)
    strategy, trainer = helpers.build(config, tmp_path / str(every), task)
    initial, _ = helpers.snapshot(strategy, trainer)
    writer = tf.summary.create_file_writer(str(tmp_path / f"tb{every}"))
    with writer.as_default():
      trainer.train(tf.constant(1))
    writer.flush()
    after, _ = helpers.snapshot(strategy, trainer)
    moved[every] = [a - b for a, b in zip(after, initial)]
    if every:
      assert [id(v) for v in trainer.statistics.recorder.general_variables] == [
          id(v) for v in GENERAL_IN_THE_HOOK[task_name](trainer.model)]
  for k, (fast, tape) in enumerate(zip(moved[1], moved[0])):
    scale = float(np.max(np.abs(tape)))
    assert scale > 0, f"variable {k} did not move"
    np.testing.assert_allclose(fast, tape, atol=1e-6 * max(1.0, scale), err_msg=str(k))
  batch = helpers.update_batches(config, 1, task)[0]
  expected = _oracle(config, task, initial, batch, 1, 1)
  events = helpers.summary_events(tmp_path / "tb1")
  for name in ("gns", "diversity", "mean_norm", "trace", "grad_norm", "mean_cosine"):
    (step, got), = events[f"per_example/{name}"]
    np.testing.assert_allclose(float(got), expected[name], rtol=1e-5, err_msg=name)


def test_statistics_of_a_recurrent_model_compile_with_xla(tmp_path):
  """pfor vectorizes an LSTM's while loop into ops XLA cannot compile (an If over DT_VARIANT):
  with statistics on and XLA, the first update failed with a traceback, exit 1, and
  `xla=auto` picks XLA on every GPU (a probe, 2026-12-07). Under XLA such a model's general
  path runs the loop; its statistics equal the oracle's."""
  config = helpers.tiny_config(**{"per_example.every_steps": 1, "xla": "on", "train_steps": 1,
                                  "batch_size": 8, "optimizer.name": "sgd"})
  task = example_tasks.Recurrent(config)
  strategy, trainer = helpers.build(config, tmp_path / "w", task)
  assert trainer.xla.enabled
  initial, _ = helpers.snapshot(strategy, trainer)
  writer = tf.summary.create_file_writer(str(tmp_path / "tb"))
  with writer.as_default():
    trainer.train(tf.constant(1))
  writer.flush()
  expected = _oracle(config, task, initial, helpers.update_batches(config, 1, task)[0], 1, 1)
  events = helpers.summary_events(tmp_path / "tb")
  for name in ("gns", "diversity", "mean_norm", "trace", "grad_norm", "mean_cosine"):
    (_, got), = events[f"per_example/{name}"]
    np.testing.assert_allclose(float(got), expected[name], rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("replicas,k,general_path", [(1, 1, "vectorized_map"), (1, 1, "loop"),
                                                     (2, 2, "vectorized_map")])
def test_statistics_leave_the_models_state_and_the_training_as_without_them(
    tmp_path, replicas, k, general_path):
  """The general path runs each example's forward again: it moved Dropout's seed on (every later
  mask differed: 0.03 in the weights after 10 updates) and wrote a layer's training-time state
  again (a call counter at 330 instead of 10). Found by a probe; all of it must be as without
  statistics: the weights to 1e-6, the seeds, the counter and the running mean exactly."""
  results = {}
  for every in (1, 0):
    overrides = {"per_example.every_steps": every, "per_example.general_path": general_path,
                 "accumulation.steps": k, "batch_size": 8}
    if replicas == 2:
      overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
    config = helpers.tiny_config(**overrides)
    strategy, trainer = helpers.build(config, tmp_path / str(every),
                                      example_tasks.DropoutAndState(config))
    writer = tf.summary.create_file_writer(str(tmp_path / f"tb{every}"))
    with writer.as_default():
      trainer.train(tf.constant(3))
    counting = trainer.model.layers[0]
    state = [counting.calls, counting.mean] + replica_state.seed_states(trainer.model)
    results[every] = (helpers.snapshot(strategy, trainer)[0],
                      [helpers.local_values(strategy, v) for v in state])
    if every:
      assert [v.path for v in trainer.statistics.recorder.general_variables] == [
          counting.scale.path]
  (weights_on, state_on), (weights_off, state_off) = results[1], results[0]
  for on, off in zip(weights_on, weights_off):
    np.testing.assert_allclose(on, off, rtol=0, atol=1e-6)
  assert float(state_off[0][0]) == 3 * k  # One training call per micro-step.
  for on, off in zip(state_on, state_off):
    for replica_on, replica_off in zip(on, off):
      np.testing.assert_array_equal(replica_on, replica_off)


def test_a_keras_weight_regulariser_keeps_the_direct_formulas_and_the_tape_update(tmp_path):
  """Keras reads a regularised kernel for `model.losses`, outside the layer's call: read inside
  the recording, that would demote the layer like tied weights. The trainer reads it after the
  recording, so nothing takes the general path, and the update still holds the penalty."""
  moved = {}
  for every in (1, 0):
    config = helpers.tiny_config(**{"per_example.every_steps": every, "train_steps": 1,
                                    "batch_size": 8, "optimizer.name": "sgd",
                                    "optimizer.learning_rate": 0.1})
    task = example_tasks.KernelRegularised(config)
    strategy, trainer = helpers.build(config, tmp_path / str(every), task)
    initial, _ = helpers.snapshot(strategy, trainer)
    trainer.train(tf.constant(1))
    moved[every] = [a - b for a, b in zip(helpers.snapshot(strategy, trainer)[0], initial)]
    if every:
      assert not trainer.statistics.recorder.general_variables
      assert not trainer.statistics.recorder.demoted
  for fast, tape in zip(moved[1], moved[0]):
    assert np.max(np.abs(tape)) > 0
    np.testing.assert_allclose(fast, tape, atol=1e-6)


@pytest.mark.parametrize("replicas,k,clipnorm", [(1, 1, 0.0), (2, 2, 0.01)])
def test_a_weight_regulariser_stays_out_of_the_statistics(tmp_path, replicas, k, clipnorm):
  """G in the statistics is Σ g_i / Σ w_i: the examples' loss only. The update's gradient also
  holds the kernel regulariser's, which no example's gradient does; with it in G, grad_norm,
  gns and the cosines mixed two definitions (grad_norm 0.2%, gns 1.2% off, found 2026-12-06).
  Clipping (active here) must not shrink G either."""
  overrides = {"per_example.every_steps": 1, "train_steps": 1, "batch_size": 8,
               "accumulation.steps": k, "optimizer.global_clipnorm": clipnorm}
  if replicas == 2:
    overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
  _, trainer, initial, events = _train_with_summaries(tmp_path, overrides, 1,
                                                      example_tasks.KernelRegularised)
  if clipnorm:
    assert float(trainer.last_grad_norm.numpy()) > 2 * clipnorm, "clipping must be active"
  config, task = trainer.config, trainer.task
  batch = helpers.update_batches(config, 1, task)[0]
  expected = _oracle(config, task, initial, batch, replicas, k)
  for name in ("gns", "diversity", "mean_norm", "trace", "grad_norm", "mean_cosine"):
    (_, got), = events[f"per_example/{name}"]
    np.testing.assert_allclose(float(got), expected[name], rtol=1e-5, err_msg=name)


def test_an_activity_regulariser_is_in_each_examples_own_gradient(tmp_path):
  """The update's objective counts a Keras activity regulariser once per example (Keras divides
  it by the batch size, the trainer multiplies it by the weight sum), so the recorded output
  gradients hold each example's own penalty: g_i = grad(l_i + r_i) with unit weights."""
  overrides = {"per_example.every_steps": 1, "train_steps": 1, "batch_size": 8}
  _, trainer, initial, events = _train_with_summaries(tmp_path, overrides, 1,
                                                      example_tasks.ActivityRegularised)
  config, task = trainer.config, trainer.task

  def own_penalty(model, batch):
    logits = model(batch["x"], training=True)
    return (tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["y"], logits=logits)
            + 0.05 * tf.reduce_sum(tf.square(logits), axis=1))
  batch = helpers.update_batches(config, 1, task)[0]
  expected = _oracle(config, task, initial, batch, 1, 1, own_penalty)
  without = _oracle(config, task, initial, batch, 1, 1)
  for name in ("gns", "diversity", "mean_norm", "trace", "grad_norm", "mean_cosine"):
    (_, got), = events[f"per_example/{name}"]
    np.testing.assert_allclose(float(got), expected[name], rtol=1e-5, err_msg=name)
  assert abs(without["mean_norm"] / expected["mean_norm"] - 1) > 1e-3  # The penalty counts.


def test_general_path_error_in_the_trainer_is_one_line_without_the_apis_advice(tmp_path):
  """The refusal named the variables, then advised passing `variables`, which a trainer user
  cannot do (a probe, 2026-12-06)."""
  config = helpers.tiny_config(**{"per_example.every_steps": 1,
                                  "per_example.general_path": "error"})
  with pytest.raises(errors.ConfigError, match=(
      r"^`per_example.general_path`=error: per_example: general_path='error' and 2 variable\(s\) "
      r"have no direct formula: .*gamma .*; allowed: vectorized_map, loop, error$")) as raised:
    helpers.build(config, tmp_path, example_tasks.InferenceBatchNorm(config))
  assert "`variables`" not in str(raised.value)


def test_batch_normalization_in_training_mode_is_refused_at_the_first_trace(tmp_path):
  config = helpers.tiny_config(**{"model": "small_cnn_bn", "per_example.every_steps": 1})
  _, trainer = helpers.build(config, tmp_path)
  with pytest.raises(errors.ConfigError, match=(
      r"^`per_example.every_steps`=1: per_example: BatchNormalization layer '.*' runs with "
      r"training=True \(batch statistics mix examples")):
    trainer.train(tf.constant(1))


def test_statistics_refuse_a_model_called_on_several_rows_per_example(tmp_path):
  config = helpers.tiny_config(**{"task": "triplet", "model": "vgg_small",
                                  "data.image_size": 32, "per_example.every_steps": 1})
  with pytest.raises(ValueError, match="`per_example.every_steps` needs one model row per example"):
    helpers.build(config, tmp_path)


@pytest.mark.parametrize("precision", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_update_with_statistics_on_every_update_equals_the_tape(tmp_path,
                                                                                precision):
  """Under a mixed policy a layer reads its variables through float16/bfloat16 casts; the
  per-example terms must still be found for them, since with statistics on every update the
  recorded layers' update gradient IS the sum of those terms (a lost term was a zero gradient:
  the layer silently stopped training)."""
  moved = {}
  for every, policy in ((1, precision), (0, precision), (0, "float32")):
    overrides = dict({"model": "small_cnn", "mixed_precision": policy, "optimizer.name": "sgd",
                      "optimizer.learning_rate": 0.1, "per_example.every_steps": every,
                      "accumulation.steps": 2, "train_steps": 2,
                      # Small enough that TF's float16 kernel gradients do not overflow (at
                      # 2^15 the tape's run skipped an update the terms' float32 sums kept).
                      "loss_scale.initial": 16.0})
    strategy, trainer = helpers.build(helpers.tiny_config(**overrides),
                                      tmp_path / f"{every}_{policy}")
    initial, _ = helpers.snapshot(strategy, trainer)
    trainer.train(tf.constant(2))
    assert trainer.gradients_from_statistics_traced == (every == 1)
    assert int(trainer.skipped_updates.numpy()) == 0
    after, _ = helpers.snapshot(strategy, trainer)
    moved[every, policy] = [a - b for a, b in zip(after, initial)]
  for k, (fast, tape, exact) in enumerate(zip(moved[1, precision], moved[0, precision],
                                              moved[0, "float32"])):
    scale = float(np.max(np.abs(exact)))
    assert scale > 0, f"variable {k} did not move"
    # The terms compute in float32 from the low-precision output gradients, TF's own kernel
    # gradients in the low precision: both are off the float32 run by the precision's rounding
    # (measured on one batch of this model: up to 8% float16, 14% bfloat16 of the largest
    # step, more on some CPUs' kernels than others), and the terms must be no further off
    # than the tape. A lost term is 100% off.
    fast_error = float(np.max(np.abs(fast - exact))) / scale
    tape_error = float(np.max(np.abs(tape - exact))) / scale
    assert fast_error <= 1.5 * tape_error + 1e-4, (k, precision, fast_error, tape_error)
    assert float(np.max(np.abs(fast - tape))) <= 0.5 * scale, (k, precision)


def test_a_layer_called_inside_a_loop_of_the_forward_is_one_config_error(tmp_path):
  config = helpers.tiny_config(**{"per_example.every_steps": 1, "train_steps": 1})
  _, trainer = helpers.build(config, tmp_path, example_tasks.LoopedDense(config))
  with pytest.raises(errors.ConfigError) as info:
    trainer.train(tf.constant(1))
  message = str(info.value)
  assert message.startswith("`per_example.every_steps`=1: per_example: Dense '"), message
  assert "nested function or loop" in message and "\n" not in message
  assert message.endswith("; set it to 0 for this model"), message  # No library-caller advice.


@pytest.mark.parametrize("model,warned", [("small_cnn", True), ("mlp", False)])
def test_statistics_on_eigen_kernels_warn_once_for_models_with_convolutions(
    tmp_path, monkeypatch, caplog, model, warned):
  monkeypatch.setattr(kernels, "eigen_cpu", lambda: True)
  with caplog.at_level("WARNING"):
    helpers.build(helpers.tiny_config(**{"model": model, "per_example.every_steps": 1}), tmp_path)
  assert caplog.text.count("TF_ENABLE_ONEDNN_OPTS=1") == int(warned), caplog.text
