"""Ghost statistics terms: per-example squared norms now, dots with a gradient known later.

    rec, dzs = ...                               # recording.py: the caller's forward/backward
    terms = ghost_norms(rec, dzs, general_grads=recorder.general_gradients(loss_fn, batch))
    terms.sq_norms                               # [B, V] per-variable |g_iv|^2
    ... all-reduce, e.g. of terms.batch_sums (or the caller's own gradient) ...
    dots = terms.dots(global_grads)              # [B] <g_i, G>, G one tensor per variable

Per variable, one of:
* ghost (`Recording.ghost_indices()`: one recorded call, a Gram form exists and is cheaper, or
  `layer_method='ghost'`): |g_i|^2 by the Gram trick, <g_i, G> by the forward formula at G
  (`terms.py`), the batch sum by the contraction over batch and positions (what backprop
  computes). Nothing of size [B, P_layer] is formed.
* materialised (small layers, normalisation scales, biases, depthwise kernels, layers called
  more than once): the layer's per-example gradients [B, P_layer] are formed and kept until
  `dots`; norms, batch sums and dots are read from them. The per-layer choice bounds their size
  by the layer's activations (`terms.KEPT_FLOAT_COST`).
* general (`general_grads`, from the general path): materialised like the above.

`example_scale` c_i: when the caller's loss is sum_i c_i loss_i (e.g. weights / global count),
the recorded dz rows are c_i g_i; they are divided by c_i (0 where c_i = 0) so that every
quantity describes g_i = grad loss_i. General-path gradients are already unscaled.
Eager or traced, replica or cross-replica context; no communication. Call `dots` in the same
function (trace) as `ghost_norms`: it reuses the recorded tensors.
"""
import tensorflow as tf

from trainer.per_example import terms as terms_lib


class GhostTerms:
  """Per-example squared norms of one batch, and `dots` against a gradient given later.

  Attributes:
    sq_norms: [B, V] float32, |g_iv|^2 per example and variable (order of `rec.recorder.variables`).
    batch_sums: per variable, sum_i g_iv (float32, variable-shaped): the batch gradient of
      sum_i loss_i (unused ones cost nothing inside tf.function: pruned).
    ghost_indices: the variables whose norms and dots use Gram and forward forms.
  """

  def __init__(self, sq_norms, batch_sums, ghost, kept, output_grads):
    self.sq_norms = sq_norms
    self.batch_sums = batch_sums
    self.ghost_indices = sorted(ghost)
    self._ghost, self._kept, self._output_grads = ghost, kept, output_grads

  def dots(self, grads) -> tf.Tensor:
    """[B] per-example <g_i, G> with G given as one tensor per variable (e.g. all-reduced)."""
    parts = []
    for index, g in enumerate(grads):
      if index in self._kept:
        parts.append(tf.linalg.matvec(self._kept[index],
                                      tf.reshape(tf.cast(g, tf.float32), [-1])))
      elif index in self._ghost:
        term = self._ghost[index]
        parts.append(term.dots(self._output_grads[term.output], g))
    return tf.add_n(parts)


def _scaled(output_grads, example_scale):
  grads = [tf.cast(g, tf.float32) for g in output_grads]
  if example_scale is None:
    return grads
  inverse = tf.math.divide_no_nan(1.0, tf.cast(example_scale, tf.float32))
  return [g * tf.reshape(inverse, [-1] + [1] * (g.shape.rank - 1)) for g in grads]


def ghost_norms(rec, output_grads, *, general_grads=None, example_scale=None,
                batch_size=None) -> GhostTerms:
  """Per-example squared norms for every variable of `rec.recorder`, without [B, P].

  Args:
    rec: the `recording.Recording` of the forward pass.
    output_grads: gradients of the loss w.r.t. `rec.outputs`, from the same backward pass.
    general_grads: [B, *shape] per `rec.recorder.general_variables` (required when any).
    example_scale: optional [B] c_i, see the module docstring.
    batch_size: B, needed only when nothing was recorded and there are no general variables.
  """
  recorder = rec.recorder
  general_grads = list(general_grads or [])
  if len(general_grads) != len(recorder.general_indices):
    raise ValueError(
        f"ghost_norms: {len(recorder.general_indices)} general-path variable(s) "
        f"({', '.join(v.path for v in recorder.general_variables)}) need `general_grads` from "
        f"`Recorder.general_gradients`; got {len(general_grads)} tensors.")
  dzs = _scaled(output_grads, example_scale)
  size = batch_size if rec.batch_size is None else rec.batch_size
  ghost = {i: rec.terms[i][0] for i in rec.ghost_indices()}
  kept = {}
  for i, g in zip(recorder.general_indices, general_grads):
    kept[i] = terms_lib.flat(g)
  for i in rec.terms:
    if i not in ghost:
      kept[i] = terms_lib.flat(rec.variable_gradients(i, dzs, size))
  columns, sums = [], []
  for i, v in enumerate(recorder.variables):
    if i in ghost:
      dz = dzs[ghost[i].output]
      columns.append(ghost[i].gram_norms(dz))
      sums.append(ghost[i].batch_sum(dz))
    else:
      columns.append(tf.reduce_sum(tf.square(kept[i]), axis=1))
      sums.append(tf.reshape(tf.reduce_sum(kept[i], axis=0), v.shape))
  return GhostTerms(tf.stack(columns, axis=1), sums, ghost, kept, dzs)
