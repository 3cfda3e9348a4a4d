"""Gradient statistics from per-example gradients, combined across replicas in ONE all-reduce.

`replica_statistics` runs in replica context (inside `strategy.run`, or directly under the
default strategy), eagerly or traced. Each replica reduces its [b, *shape] per-example grads to
sums; everything reducible is concatenated into one flat float32 vector and SUM-all-reduced once;
the cosines to the global batch gradient are computed after that reduction; per-example values
are gathered with one `all_gather` for logging. The pure functions below (`diversity`,
`trace_estimate`, `noise_scale`, `cosines`) hold the math and run on numbers or tensors in any
context.

Notation: g_i per-example gradient (loss of example i alone), B global batch, R replicas,
S1 = sum_i g_i, n2 = sum_i |g_i|^2, G = S1 / B (the batch-mean gradient).
* trace  = tr(Sigma) estimate = (n2 - B |G|^2) / (B - 1)   (unbiased sample covariance trace)
* variance = trace / P (mean per-coordinate variance, P parameters)
* diversity = n2 / |S1|^2   (Yin et al. 2018; 1/B for identical g_i, 1 for orthogonal equal norms)
* gns = B_simple = S / |G|^2 (McCandlish et al. 2018) from two batch sizes b_s < b_b:
    |G|^2_est = (b_b |G_b|^2 - b_s |G_s|^2) / (b_b - b_s),
    S_est     = (|G_s|^2 - |G_b|^2) / (1/b_s - 1/b_b).
  With R > 1: b_s = B/R (per-replica batch; |G_s|^2 is the mean over replicas of the squared
  norm of each replica's mean gradient, taken before the all-reduce), b_b = B.
  With R = 1: b_s = 1 (|G_s|^2 = n2/B), which makes S_est the unbiased tr(Sigma) and
  |G|^2_est = (B|G|^2 - n2/B)/(B-1): B_simple = tr(Sigma)/|G|^2 from within the batch.
  `gns_example` is always the b_s = 1 version (equal for any R on the same global batch).
  Smooth `gns_s` and `gns_g2` separately over steps (EMA) before dividing, as McCandlish advise.
"""
from typing import Sequence

import tensorflow as tf


# ---------------------------------------------------------------- pure math (any context) --
def diversity(sum_sq_norms, sum_grad_sq_norm):
  """Gradient diversity sum_i |g_i|^2 / |sum_i g_i|^2."""
  return sum_sq_norms / sum_grad_sq_norm


def trace_estimate(sum_sq_norms, mean_grad_sq_norm, count):
  """Unbiased tr(Sigma): (sum_i |g_i|^2 - B |G|^2) / (B - 1), G the mean gradient."""
  return (sum_sq_norms - count * mean_grad_sq_norm) / (count - 1.0)


def noise_scale(small_sq_norm, big_sq_norm, b_small, b_big):
  """McCandlish et al. B_simple from |G|^2 at two batch sizes; returns (b_simple, s, g2)."""
  g2 = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
  s = (small_sq_norm - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
  return s / g2, s, g2


def cosines(dots, norms, grad_norm, eps=1e-30):
  """cos(g_i, G) = g_i.G / (|g_i| |G|); 0 where a norm is 0."""
  return dots / tf.maximum(norms * grad_norm, eps)


# ------------------------------------------------------------------- replica context --------
def _sum(tensors):
  """Sum of same-shape tensors without AddN (AddN is what cross-device reduction emits)."""
  return tf.reduce_sum(tf.stack(tensors), axis=0)


def _flat(t):
  return tf.reshape(tf.cast(t, tf.float32), [tf.shape(t)[0], -1])


def replica_statistics(per_example_grads: Sequence[tf.Tensor], variables: Sequence,
                       *, return_batch_grads: bool = False) -> dict:
  """Statistics of this step's per-example gradients over the GLOBAL batch (all replicas).

  Runs in replica context (inside `strategy.run`, or plainly under the default strategy),
  eagerly or traced. Communication: one SUM `all_reduce` of a packed float32 vector, then one
  `all_gather` of the per-example values. Every replica returns the same values.

  Args:
    per_example_grads: this replica's `[b, *var.shape]` tensors, one per variable (e.g. from
      `trainer.per_example.per_example_gradients`).
    variables: the matching variables (shapes are checked; the order defines `var_norms`).
    return_batch_grads: also return `batch_grads`, the all-reduced mean gradient G per variable.

  Returns:
    A dict of float32 tensors. Scalars: `count` (B), `grad_norm` (|G|), `mean_norm` (mean_i
    |g_i|), `mean_sq_norm` (mean_i |g_i|^2), `trace`, `variance`, `diversity`, `gns`
    (B_simple), `gns_s`, `gns_g2` (its numerator and denominator), `gns_example` (b_s = 1
    version), `mean_cosine` (mean_i cos(g_i, G)). Per variable [V]: `var_mean_norm`,
    `var_mean_sq_norm`. Gathered over the global batch, replica-major: `norms` [B], `cosines` [B],
    `var_norms` [B, V]. Optional `batch_grads`: list of G per variable.
  """
  if len(per_example_grads) != len(variables):
    raise ValueError(f"per_example_grads has {len(per_example_grads)} tensors but variables has "
                     f"{len(variables)}; pass one [b, *var.shape] tensor per variable.")
  for g, v in zip(per_example_grads, variables):
    if not g.shape[1:].is_compatible_with(v.shape):
      raise ValueError(f"per_example_grads: shape {g.shape} does not match [b, *{v.shape}] of "
                       f"variable {getattr(v, 'path', getattr(v, 'name', '?'))}.")
  ctx = tf.distribute.get_replica_context()
  if ctx is None:
    raise ValueError("replica_statistics must run in replica context: inside strategy.run, or "
                     "outside any strategy.scope().")
  replicas = float(ctx.num_replicas_in_sync)
  flats = [_flat(g) for g in per_example_grads]
  local_count = tf.cast(tf.shape(flats[0])[0], tf.float32)
  var_sq = tf.stack([tf.reduce_sum(tf.square(f), axis=1) for f in flats], axis=1)  # [b, V]
  sq_norms = tf.reduce_sum(var_sq, axis=1)  # [b]
  norms = tf.sqrt(sq_norms)
  var_norms = tf.sqrt(var_sq)
  s1 = [tf.reduce_sum(f, axis=0) for f in flats]
  local_mean_sq = _sum([tf.reduce_sum(tf.square(s)) for s in s1]) / tf.square(
      tf.maximum(local_count, 1.0))
  sizes = [int(tf.TensorShape(v.shape).num_elements()) for v in variables]
  num_vars = len(variables)
  packed = tf.concat(s1 + [
      tf.reduce_sum(var_sq, axis=0),            # [V]  sum_i |g_i,v|^2
      tf.reduce_sum(var_norms, axis=0),         # [V]  sum_i |g_i,v|
      tf.stack([tf.reduce_sum(norms),           # sum_i |g_i|
                local_count,                    # b
                local_mean_sq]),                # |G_replica|^2
  ], axis=0)
  total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, packed)  # The ONE all-reduce.

  pieces = tf.split(total, sizes + [num_vars, num_vars, 3])
  count = pieces[-1][1]
  grads = [p / count for p in pieces[:len(sizes)]]  # G per variable, flat.
  var_sum_sq, var_sum_norm = pieces[len(sizes)], pieces[len(sizes) + 1]
  sum_norm, small_sq = pieces[-1][0], pieces[-1][2] / replicas
  sum_sq = tf.reduce_sum(var_sum_sq)
  grad_sq = _sum([tf.reduce_sum(tf.square(g)) for g in grads])
  grad_norm = tf.sqrt(grad_sq)

  dots = _sum([tf.linalg.matvec(f, g) for f, g in zip(flats, grads)])  # [b], after the reduce.
  local_cos = cosines(dots, norms, grad_norm)
  gathered = ctx.all_gather(
      tf.concat([norms[:, None], local_cos[:, None], var_norms], axis=1), axis=0)

  trace = trace_estimate(sum_sq, grad_sq, count)
  gns_example, _, _ = noise_scale(sum_sq / count, grad_sq, 1.0, count)
  if replicas > 1:
    gns, gns_s, gns_g2 = noise_scale(small_sq, grad_sq, count / replicas, count)
  else:
    gns, gns_s, gns_g2 = noise_scale(sum_sq / count, grad_sq, 1.0, count)
  stats = {
      "count": count,
      "grad_norm": grad_norm,
      "mean_norm": sum_norm / count,
      "mean_sq_norm": sum_sq / count,
      "trace": trace,
      "variance": trace / float(sum(sizes)),
      "diversity": diversity(sum_sq, grad_sq * tf.square(count)),
      "gns": gns,
      "gns_s": gns_s,
      "gns_g2": gns_g2,
      "gns_example": gns_example,
      "mean_cosine": tf.reduce_mean(gathered[:, 1]),
      "var_mean_norm": var_sum_norm / count,
      "var_mean_sq_norm": var_sum_sq / count,
      "norms": gathered[:, 0],
      "cosines": gathered[:, 1],
      "var_norms": gathered[:, 2:],
  }
  if return_batch_grads:
    stats["batch_grads"] = [tf.reshape(g, v.shape) for g, v in zip(grads, variables)]
  return stats
