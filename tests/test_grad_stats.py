"""Gradient statistics: closed forms, numpy references, noise scale, and the multi-replica path.

The 2 logical CPUs come from tests/conftest.py. Under MirroredStrategy on CPUs TF uses
CollectiveAllReduce, so one `all_reduce` of one packed tensor traces to exactly one
CollectiveReduceV2 op per replica device (one collective); every separate all-reduce would add
one more per device. That op count in the traced graph is the check.
"""
import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.per_example import statistics
from trainer import strategies
from trainer.per_example import per_example_gradients

SCALARS = ("count", "grad_norm", "mean_norm", "mean_sq_norm", "trace", "variance", "diversity",
           "gns_example", "mean_cosine")


def _vars(*shapes):
  return [tf.Variable(tf.zeros(s)) for s in shapes]


def _stats(grads, variables):
  out = statistics.replica_statistics([tf.constant(g, tf.float32) for g in grads], variables)
  return {k: v.numpy() for k, v in out.items()}


def test_identical_examples_cosine_one_diversity_one_over_b():
  rng = np.random.default_rng(0)
  b = 6
  one = [rng.normal(size=(3, 2)), rng.normal(size=(4,))]
  s = _stats([np.repeat(o[None], b, axis=0) for o in one], _vars((3, 2), (4,)))
  np.testing.assert_allclose(s["cosines"], np.ones(b), rtol=1e-6)
  np.testing.assert_allclose(s["diversity"], 1.0 / b, rtol=1e-6)
  np.testing.assert_allclose(s["trace"], 0.0, atol=1e-5)


def test_orthogonal_equal_norm_diversity_one():
  g = 3.0 * np.eye(5, dtype=np.float32)  # 5 examples, orthogonal, |g_i| = 3.
  s = _stats([g], _vars((5,)))
  np.testing.assert_allclose(s["diversity"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(s["norms"], np.full(5, 3.0), rtol=1e-6)
  np.testing.assert_allclose(s["cosines"], np.full(5, 1 / np.sqrt(5)), rtol=1e-6)


def test_one_example_leaves_covariance_estimates_undefined_and_the_rest_exact():
  g = np.array([[3.0, 4.0]], np.float32)
  s = _stats([g], _vars((2,)))
  for key in ("trace", "variance", "gns", "gns_s", "gns_g2", "gns_example"):
    assert np.isnan(s[key]), (key, s[key])  # 0/0: was +-inf or NaN, as rounding fell.
  np.testing.assert_allclose([s["count"], s["grad_norm"], s["mean_norm"], s["diversity"]],
                             [1.0, 5.0, 5.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(s["cosines"], [1.0], rtol=1e-6)
  # The sums as rounding may leave them (sum of squares a hair above |G|^2): 0+/0 gave +inf.
  sums = tf.constant([25.000002, 5.0, 5.0, 1.0, 25.000002])
  rounded = statistics.statistics_from_sums(sums, tf.constant(25.0), num_small_batches=1,
                                            num_parameters=2)
  for key in ("trace", "variance", "gns", "gns_s", "gns_g2", "gns_example"):
    assert np.isnan(rounded[key].numpy()), (key, rounded[key])


def test_moments_match_numpy():
  rng = np.random.default_rng(1)
  b = 9
  grads = [rng.normal(1.0, 2.0, size=(b, 3, 2)), rng.normal(size=(b, 4))]
  s = _stats(grads, _vars((3, 2), (4,)))
  flat = np.concatenate([g.reshape(b, -1) for g in grads], axis=1).astype(np.float64)
  mean = flat.mean(axis=0)
  trace = np.trace(np.cov(flat, rowvar=False, ddof=1))
  norms = np.linalg.norm(flat, axis=1)
  cos = flat @ mean / (norms * np.linalg.norm(mean))
  np.testing.assert_allclose(s["trace"], trace, rtol=1e-5)
  np.testing.assert_allclose(s["variance"], trace / flat.shape[1], rtol=1e-5)
  np.testing.assert_allclose(s["grad_norm"], np.linalg.norm(mean), rtol=1e-5)
  np.testing.assert_allclose(s["norms"], norms, rtol=1e-5)
  np.testing.assert_allclose(s["mean_norm"], norms.mean(), rtol=1e-5)
  np.testing.assert_allclose(s["cosines"], cos, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(s["mean_cosine"], cos.mean(), rtol=1e-5)
  np.testing.assert_allclose(s["diversity"], (norms**2).sum() / (flat.sum(0)**2).sum(),
                             rtol=1e-5)
  var_norms = np.stack([np.linalg.norm(g.reshape(b, -1), axis=1) for g in grads], axis=1)
  np.testing.assert_allclose(s["var_norms"], var_norms, rtol=1e-5)
  np.testing.assert_allclose(s["var_mean_sq_norm"], (var_norms**2).mean(0), rtol=1e-5)


def test_noise_scale_recovers_known_value_on_linear_regression():
  # l_i = (x_i.w - y_i)^2 / 2, y = x.w* + eps, x ~ N(0, I_d), eps ~ N(0, sigma^2). At w:
  # g_i = r_i x_i with r_i = x_i.delta - eps_i, delta = w - w*; G = delta and
  # tr(Sigma) = (d + 1)|delta|^2 + d sigma^2 (Gaussian 4th moments), so the true
  # B_simple = tr(Sigma)/|G|^2 = 51 for d = 10, |delta| = 1, sigma = 2.
  d, sigma, b = 10, 2.0, 100_000
  rng = np.random.default_rng(42)
  delta = np.zeros(d)
  delta[0] = 1.0
  x = rng.normal(size=(b, d))
  r = x @ delta - sigma * rng.normal(size=b)
  s = _stats([(r[:, None] * x).astype(np.float32)], _vars((d,)))
  true = ((d + 1) + d * sigma**2) / 1.0
  assert abs(s["gns"] / true - 1) < 0.05, (s["gns"], true)
  assert abs(s["trace"] / true - 1) < 0.05, (s["trace"], true)  # |G|^2 = 1 here.
  np.testing.assert_allclose(s["gns"], s["gns_example"], rtol=1e-6)  # One replica: b_s = 1.


def test_pure_noise_scale_formula():
  # With exact expectations |G_b|^2 = g2 + S/b: the estimator returns S and g2 exactly.
  g2, s_true = 2.0, 30.0
  small, big = g2 + s_true / 8, g2 + s_true / 64
  b_simple, s, g = statistics.noise_scale(small, big, 8.0, 64.0)
  np.testing.assert_allclose([b_simple, s, g], [s_true / g2, s_true, g2], rtol=1e-12)


def _tiny_model():
  keras.utils.set_random_seed(3)
  return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                           keras.layers.LayerNormalization(), keras.layers.Dense(3)])


def _loss(model, batch):
  x, y = batch
  return keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                      from_logits=True)


def test_mirrored_two_replicas_equal_single_replica_and_one_all_reduce():
  assert len(tf.config.list_logical_devices("CPU")) >= 2, "tests/conftest.py splits the CPU"
  rng = np.random.default_rng(5)
  b = 8
  x = tf.constant(rng.normal(size=(b, 5)), tf.float32)
  y = tf.constant(rng.integers(0, 3, size=b), tf.int32)
  strategy = strategies.mirrored_strategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    model = _tiny_model()

  def replica_step(xs, ys):
    grads = per_example_gradients(model, _loss, (xs, ys))
    return statistics.replica_statistics(grads, model.trainable_variables)

  @tf.function
  def step(xs, ys):
    return strategy.run(replica_step, args=(xs, ys))

  halves = lambda t: strategy.experimental_distribute_values_from_function(
      lambda ctx: t[ctx.replica_id_in_sync_group * b // 2:][:b // 2])
  dx, dy = halves(x), halves(y)
  dist = {k: [r.numpy() for r in strategy.experimental_local_results(v)]
          for k, v in step(dx, dy).items()}

  # Single replica on the same global batch (default strategy, eager).
  single_model = _tiny_model()
  single_grads = per_example_gradients(single_model, _loss, (x, y))
  single = statistics.replica_statistics(single_grads, single_model.trainable_variables)
  for key in SCALARS + ("norms", "cosines", "var_norms", "var_mean_norm"):
    for replica_value in dist[key]:  # Both replicas hold the global value.
      np.testing.assert_allclose(replica_value, single[key].numpy(), rtol=1e-5, atol=1e-7,
                                 err_msg=key)

  # gns with b_small = per-replica batch: the estimator on numpy means of the two halves.
  flat = np.concatenate([g.numpy().reshape(b, -1) for g in single_grads], axis=1)
  halves_sq = np.mean([np.sum(flat[i * 4:(i + 1) * 4].mean(0)**2) for i in range(2)])
  expected = statistics.noise_scale(halves_sq, np.sum(flat.mean(0)**2), 4.0, 8.0)
  for replica_value in dist["gns"]:
    np.testing.assert_allclose(replica_value, expected[0], rtol=1e-4)

  ops = collections.Counter(
      op.type for op in step.get_concrete_function(dx, dy).graph.get_operations())
  reduces = {t: n for t, n in ops.items()
             if t.startswith("Collective") and "Reduce" in t or t == "NcclAllReduce"}
  assert reduces == {"CollectiveReduceV2": strategy.num_replicas_in_sync}, reduces


def test_argument_errors():
  with pytest.raises(ValueError, match="per_example_grads has 1 tensors"):
    statistics.replica_statistics([tf.zeros([2, 3])], _vars((3,), (2,)))
  with pytest.raises(ValueError, match="does not match"):
    statistics.replica_statistics([tf.zeros([2, 4])], _vars((3,)))
