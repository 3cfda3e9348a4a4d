"""Gradient statistics of the GLOBAL batch, combined across replicas in ONE all-reduce.

Notation: g_i per-example gradient (loss of example i alone), B global batch, R replicas,
S1 = sum_i g_i, n2 = sum_i |g_i|^2, G = S1 / B (the batch-mean gradient).
* trace  = tr(Sigma) estimate = (n2 - B |G|^2) / (B - 1)   (unbiased sample covariance trace)
* variance = trace / P (mean per-coordinate variance, P parameters)
* diversity = n2 / |S1|^2   (Yin et al. 2018; 1/B for identical g_i, 1 for orthogonal equal norms)
* gns = B_simple = S / |G|^2 (McCandlish et al. 2018) from two batch sizes b_s < b_b:
    |G|^2_est = (b_b |G_b|^2 - b_s |G_s|^2) / (b_b - b_s),
    S_est     = (|G_s|^2 - |G_b|^2) / (1/b_s - 1/b_b).
  With several small batches (R replicas): b_s = B/R, |G_s|^2 the mean over them of the squared
  norm of each one's mean gradient (taken before the all-reduce), b_b = B. With one: b_s = 1
  (|G_s|^2 = n2/B), which makes S_est the unbiased tr(Sigma). `gns_example` is always the
  b_s = 1 version. Smooth `gns_s` and `gns_g2` separately over steps before dividing.

Three layers of API:
* pure math on numbers or tensors, any context: `diversity`, `trace_estimate`, `noise_scale`,
  `cosines`, and `local_sums` / `statistics_from_sums`, which a trainer uses to fold these sums
  into its own packed all-reduce;
* `replica_statistics(per_example_grads, variables)`: from materialised [b, *shape] gradients;
* `ghost_statistics(model, loss_fn, batch)`: from the ghost path (ghost.py), never forming
  [b, P]. Both run in replica context (inside `strategy.run`, or plainly under the default
  strategy), eagerly or traced, with one SUM all-reduce of a packed float32 vector (the sums
  and S1), the dots against the reduced G, then one all_gather of the per-example values. Every
  replica returns the same dict.
"""
from typing import Sequence

import tensorflow as tf

from trainer import autograph
from trainer.per_example import ghost
from trainer.per_example import recording
from trainer.per_example import terms


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


@autograph.library
def local_sums(var_sq_norms, small_grad_sq_norm, counted=None):
  """This replica's SUM-reducible statistics: a float32 vector [2V + 3].

  Layout: sum_i |g_iv|^2 (V), sum_i |g_iv| (V), sum_i |g_i|, b, |G_small|^2, where
  `var_sq_norms` is [b, V] and `small_grad_sq_norm` the squared norm of this small batch's mean
  gradient (for the noise scale). `counted` ([b] of 1 and 0, default all 1) says which rows are
  examples: b counts those (rows of 0 must have g_i = 0, e.g. examples of weight 0). Add vectors
  of several small batches (replicas, micro-batches) by summing them; any context.
  """
  var_sq_norms = tf.cast(var_sq_norms, tf.float32)
  return _local_sums(var_sq_norms, tf.sqrt(var_sq_norms),
                     tf.sqrt(tf.reduce_sum(var_sq_norms, axis=1, keepdims=True)),
                     tf.cast(small_grad_sq_norm, tf.float32), counted)


def _local_sums(var_sq_norms, var_norms, norms, small_grad_sq_norm, counted=None):
  """`local_sums` from the [b, V], [b, V] and [b, 1] per-example values already at hand."""
  counted = tf.ones_like(norms) if counted is None else tf.reshape(
      tf.cast(counted, tf.float32), [-1, 1])
  per_example = tf.concat([var_sq_norms, var_norms, norms, counted], axis=1)
  return tf.concat([tf.reduce_sum(per_example, axis=0),
                    tf.reshape(small_grad_sq_norm, [1])], axis=0)


@autograph.library
def statistics_from_sums(sums, grad_sq_norm, *, num_small_batches, num_parameters) -> dict:
  """The scalar statistics from summed `local_sums` and |G|^2 of the global mean gradient.

  Pure; any context. `num_small_batches` is how many `local_sums` vectors were added (R
  replicas, or R x k micro-batches); with 1 the noise scale uses b_small = 1.
  Returns count, grad_norm, mean_norm, mean_sq_norm, trace, variance, diversity, gns, gns_s,
  gns_g2, gns_example, var_mean_norm [V], var_mean_sq_norm [V]. With one example (count 1)
  trace, variance and the noise scales are NaN (undefined).

  Written as few vector ops (each graph node costs tens of KB of resident memory in TF's
  runtime; docs/per_example.md): both noise-scale estimates at once, one select, one unstack.
  """
  num_vars = (int(sums.shape[0]) - 3) // 2
  grad_sq_norm = tf.cast(grad_sq_norm, tf.float32)
  var_sums, tail = tf.split(sums, [2 * num_vars, 3])
  sum_norm, count, small_total = tf.unstack(tail)
  var_mean_sq_norm, var_mean_norm = tf.split(var_sums / count, 2)
  example_sq = tf.reduce_sum(var_mean_sq_norm)  # |G|^2 at batch size 1: mean_i |g_i|^2.
  if num_small_batches > 1:  # [small batches vs all, single examples vs all].
    small_sq = tf.stack([small_total / num_small_batches, example_sq])
    b_small = tf.stack([count / num_small_batches, tf.ones_like(count)])
  else:
    small_sq, b_small = tf.stack([example_sq, example_sq]), tf.ones([2])
  gns, s, g2 = noise_scale(small_sq, grad_sq_norm, b_small, count)
  # One example has no covariance: these divide 0 by 0, whose sign rounding would pick.
  estimates = tf.where(count > 1.0, tf.stack([gns, s, g2]), float("nan"))
  gns, gns_example, gns_s, trace, gns_g2, _ = tf.unstack(tf.reshape(estimates, [6]))
  return {  # S at b_s = 1 is tr(Sigma).
      "count": count, "grad_norm": tf.sqrt(grad_sq_norm), "mean_norm": sum_norm / count,
      "mean_sq_norm": example_sq, "trace": trace, "variance": trace / float(num_parameters),
      "diversity": diversity(example_sq, grad_sq_norm * count), "gns": gns,
      "gns_s": gns_s, "gns_g2": gns_g2, "gns_example": gns_example,
      "var_mean_norm": var_mean_norm, "var_mean_sq_norm": var_mean_sq_norm}


# ------------------------------------------------------------------- replica context --------
def _replica_context():
  ctx = tf.distribute.get_replica_context()
  if ctx is None:
    raise ValueError("per-example statistics must run in replica context: inside strategy.run, "
                     "or outside any strategy.scope().")
  return ctx


def _combine(ctx, found, return_batch_grads):
  """One packed all-reduce of (S1, local_sums), dots against G, one all_gather.

  `found`: this replica's `ghost.GhostTerms` (built with self_dots=True when ctx has one
  replica: then G is this batch's own mean gradient and the dots are already known).
  """
  var_sq, local = found.sq_norms, found.packed_sums
  num_params = sum(found.sizes)
  var_norms = tf.sqrt(var_sq)
  norms = tf.sqrt(tf.reduce_sum(var_sq, axis=1, keepdims=True))  # [b, 1]
  sums = _local_sums(var_sq, var_norms, norms, found.mean_grad_sq_norm)
  total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat([local, sums], 0))  # ONE.
  grad_sum, reduced = tf.split(total, [num_params, int(sums.shape[0])])
  count = reduced[-2]
  grad_sum_sq = tf.reduce_sum(tf.square(grad_sum))
  stats = statistics_from_sums(reduced, grad_sum_sq / tf.square(count),
                               num_small_batches=ctx.num_replicas_in_sync,
                               num_parameters=num_params)
  if found.self_dots is not None:  # <g_i, S1>, S1 = count G: cos(g_i, G) = cos(g_i, S1).
    dots = found.self_dots
  else:
    dots = found.dots_packed(grad_sum)  # After the reduce.
  local_cos = cosines(tf.reshape(dots, [-1, 1]), norms, tf.sqrt(grad_sum_sq))
  gathered = ctx.all_gather(tf.concat([norms, local_cos, var_norms], axis=1), axis=0)
  gathered_norms, gathered_cos, gathered_var_norms = tf.split(gathered, [1, 1, -1], axis=1)
  stats.update(mean_cosine=tf.reduce_mean(gathered_cos),
               norms=tf.reshape(gathered_norms, [-1]), cosines=tf.reshape(gathered_cos, [-1]),
               var_norms=gathered_var_norms)
  if return_batch_grads:
    stats["batch_grads"] = found.unpack(grad_sum / count)
  return stats


STAT_DOC = """
  Returns:
    A dict of float32 tensors. Scalars: `count` (B), `grad_norm` (|G|), `mean_norm` (mean_i
    |g_i|), `mean_sq_norm` (mean_i |g_i|^2), `trace`, `variance`, `diversity`, `gns`
    (B_simple), `gns_s`, `gns_g2` (its numerator and denominator), `gns_example` (b_s = 1
    version), `mean_cosine` (mean_i cos(g_i, G)). Per variable [V]: `var_mean_norm`,
    `var_mean_sq_norm`. Gathered over the global batch, replica-major: `norms` [B], `cosines` [B],
    `var_norms` [B, V]. Optional `batch_grads`: list of G per variable.
"""


@autograph.library
def replica_statistics(per_example_grads: Sequence[tf.Tensor], variables: Sequence,
                       *, return_batch_grads: bool = False) -> dict:
  """Statistics over the GLOBAL batch from this replica's materialised per-example gradients.

  Replica context (inside `strategy.run`, or plainly under the default strategy), eager or
  traced; one SUM all-reduce of a packed vector, one all_gather.

  Args:
    per_example_grads: this replica's `[b, *var.shape]` tensors, one per variable (e.g. from
      `per_example_gradients`).
    variables: the matching variables (shapes are checked; the order defines `var_norms`).
    return_batch_grads: also return `batch_grads`, the all-reduced mean gradient G per variable.
  """
  if not variables:
    raise ValueError("replica_statistics: `variables` is empty; pass one [b, *var.shape] "
                     "tensor per variable and the variables.")
  if len(per_example_grads) != len(variables):
    raise ValueError(f"per_example_grads has {len(per_example_grads)} tensors but variables has "
                     f"{len(variables)}; pass one [b, *var.shape] tensor per variable.")
  for g, v in zip(per_example_grads, variables):
    if not g.shape[1:].is_compatible_with(v.shape):
      raise ValueError(f"per_example_grads: shape {g.shape} does not match [b, *{v.shape}] of "
                       f"variable {recording.variable_name(v)}.")
  ctx = _replica_context()
  variables = list(variables)
  groups = [ghost.PiecesGroup((i,), [terms.flat(g)], variables)
            for i, g in enumerate(per_example_grads)]
  found = ghost.combine(variables, groups, {}, self_dots=ctx.num_replicas_in_sync == 1)
  return _combine(ctx, found, return_batch_grads)


def ghost_statistics(model, loss_fn, batch, *, variables=None,
                     general_path: str = "vectorized_map", layer_method: str = "auto",
                     return_batch_grads: bool = False) -> dict:
  """`replica_statistics` of `loss_fn(model, batch)` from the ghost path, without [b, P].

  Replica context, eager or traced. One recorded batch forward and ONE backward pass (to the
  recorded outputs only: the batch gradient S1 comes from the terms too); general-path
  variables are materialised by `general_path` (`error` refuses them). Then the same packed
  all-reduce and all_gather as `replica_statistics`.

  Args:
    model, loss_fn, batch, variables: as for `per_example_gradients`.
    general_path: `vectorized_map` | `loop` | `error`.
    layer_method: `auto` | `materialize` | `ghost`, see `recording.Recorder`.
    return_batch_grads: also return `batch_grads`.
  """
  return _ghost_statistics(model, autograph.like_caller(loss_fn), batch, variables, general_path,
                           layer_method, return_batch_grads)


@autograph.library
def _ghost_statistics(model, loss_fn, batch, variables, general_path, layer_method,
                      return_batch_grads):
  ctx = _replica_context()
  recorder = recording.Recorder(model, variables, general_path=general_path,
                                layer_method=layer_method)
  recorder.scout(loss_fn, batch)
  rec, output_grads, losses = recorder.differentiate(loss_fn, batch)
  found = ghost.ghost_norms(rec, output_grads,
                            general_grads=recorder.general_gradients(loss_fn, batch),
                            batch_size=tf.shape(losses)[0],
                            self_dots=ctx.num_replicas_in_sync == 1)
  return _combine(ctx, found, return_batch_grads)


replica_statistics.__doc__ += STAT_DOC
ghost_statistics.__doc__ += STAT_DOC
