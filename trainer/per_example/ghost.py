"""Ghost statistics terms: per-example squared norms now, dots with a gradient known later.

    recorder = Recorder(model)
    with tf.GradientTape() as tape:
      with recorder.record(tape) as rec:         # recording.py: the caller's own forward
        losses = loss_fn(model, batch)
      loss = tf.reduce_sum(c * losses)
    grads, dzs = tape.gradient(loss, (variables, rec.outputs))    # the caller's ONE backward
    terms = ghost_norms(rec, dzs, example_scale=c,
                        general_grads=recorder.general_gradients(loss_fn, batch))
    terms.sq_norms                               # [B, V] per-variable |g_iv|^2
    ... all-reduce (e.g. of the caller's gradient, or `terms.packed_sums`) ...
    dots = terms.dots(global_grads)              # [B] <g_i, G>, G one tensor per variable

Per variable, one of:
* ghost (`Recording.ghost_indices()`: one recorded call, a Gram form exists and is cheaper, or
  `layer_method='ghost'`): |g_i|^2 by the Gram trick, <g_i, G> by the forward formula at G
  (`terms.py`), the batch sum by the contraction over batch and positions (what backprop
  computes). Nothing of size [B, P_layer] is formed.
* materialised (small layers, normalisation scales, biases, depthwise kernels, layers called
  more than once, general-path variables from `general_grads`): the per-example gradients of
  that variable are formed, as row-major pieces (`Term.blocks`, e.g. one per kernel tap; a
  layer's kernel and bias together when both are materialised, `terms.Joint`), and reduced
  piece by piece. The pieces are kept until `dots` unless `self_dots=True`: then the dots with
  this batch's own gradient sum are computed in the same pass and nothing is kept (one replica:
  the global gradient is the local one).
The per-layer choice (`terms.choice_costs`) bounds the materialised size by the layer's
activations: a layer is materialised when T K O (+ K O kept) is cheaper than T^2 (K + O).

`example_scale` c_i: when the caller's loss is sum_i c_i loss_i (e.g. weights / global count),
the recorded dz rows are c_i g_i; they are divided by c_i (0 where c_i = 0) so that every
quantity describes g_i = grad loss_i. General-path gradients are already unscaled; their rows
with c_i = 0 are zeroed, so that such an example reports 0 on every variable.
Eager or traced, replica or cross-replica context; no communication. Call `dots` in the same
function (trace) as `ghost_norms`: it reuses the recorded tensors.
"""
import numpy as np
import tensorflow as tf

from trainer import autograph
from trainer.per_example import terms as terms_lib


def _width(variable) -> int:
  return int(np.prod(variable.shape))


def _column(t):
  """[B] -> [B, 1]."""
  return tf.reshape(t, [-1, 1])


def _dots_with(piece, row):
  """[B, n] x [1, n] -> [B, 1]: per-example dots, as a matrix product (see `reduce`)."""
  return tf.matmul(piece, row, transpose_b=True)


def _indicator(widths):
  """[sum(widths), len(widths)] float32: column j is 1 on the j-th span of rows."""
  out = np.zeros([sum(widths), len(widths)], np.float32)
  offset = 0
  for j, width in enumerate(widths):
    out[offset:offset + width, j] = 1.0
    offset += width
  return tf.constant(out)


class GhostTerms:
  """Per-example squared norms of one batch, its gradient sum, and dots against a gradient.

  Attributes:
    sq_norms: [B, V] float32 |g_iv|^2 per example and variable (order of the recorder's
      `variables`).
    packed_sums: [P] float32 sum_i g_i of every variable, flattened and concatenated in the
      order of `order` (what a packed all-reduce carries).
    order: variable indices in packing order; `sizes`: their numbers of elements.
    self_dots: [B] <g_i, sum_j g_j> when built with `self_dots=True`, else None.
    ghost_indices: variables whose norms and dots use Gram and forward forms.
  """

  def __init__(self, variables, sq_norms, packed_sums, order, kept, ghost, self_dots):
    self.sq_norms, self.packed_sums, self.self_dots = sq_norms, packed_sums, self_dots
    self.order = order
    self.sizes = [_width(variables[i]) for i in order]
    self.ghost_indices = sorted(ghost)
    self._variables = variables
    self._kept, self._ghost = kept, ghost

  def unpack(self, packed):
    """A packed [P] vector (e.g. the all-reduced sums) -> one tensor per variable, var order."""
    pieces = tf.split(packed, self.sizes)
    out = [None] * len(self._variables)
    for i, piece in zip(self.order, pieces):
      out[i] = tf.reshape(piece, self._variables[i].shape)
    return out

  @property
  def mean_grad_sq_norm(self):
    """|sum_i g_i / B|^2, this batch's mean gradient's squared norm (0 for an empty batch)."""
    count = tf.cast(tf.shape(self.sq_norms)[0], tf.float32)
    return tf.reduce_sum(tf.square(self.packed_sums)) / tf.square(tf.maximum(count, 1.0))

  @property
  def batch_sums(self):
    """sum_i g_iv per variable, in variable order."""
    return self.unpack(self.packed_sums)

  @autograph.library
  def dots(self, grads) -> tf.Tensor:
    """[B] per-example <g_i, G>, G given as one tensor per variable (variable order)."""
    return self.dots_packed(tf.concat(
        [tf.reshape(tf.cast(grads[i], tf.float32), [-1]) for i in self.order], axis=0))

  @autograph.library
  def dots_packed(self, packed) -> tf.Tensor:
    """[B] per-example <g_i, G>, G given packed in `order` (e.g. the all-reduced vector)."""
    if self._kept is None:
      raise ValueError("GhostTerms built with self_dots=True kept no per-example pieces; "
                       "use `self_dots`, or build with self_dots=False.")
    parts, offset = [], 0
    for group, state, width in self._kept:
      parts.append(group.dots(state, packed[offset:offset + width]))
      offset += width
    for i in self.order[len(self.order) - len(self._ghost):]:
      term, dz = self._ghost[i]
      size = _width(self._variables[i])
      parts.append(_column(term.dots(dz, tf.reshape(packed[offset:offset + size],
                                                    self._variables[i].shape))))
      offset += size
    return tf.reshape(tf.add_n(parts), [-1])


def _scaled(output_grads, example_scale):
  grads = [tf.cast(g, tf.float32) for g in output_grads]
  if example_scale is None:
    return grads
  inverse = tf.math.divide_no_nan(1.0, tf.cast(example_scale, tf.float32))
  return [g * tf.reshape(inverse, [-1] + [1] * (g.shape.rank - 1)) for g in grads]


def _spans(widths, start, size):
  """[(variable, width)] of the layout positions [start, start + size)."""
  out, offset = [], 0
  for index, width in widths:
    lo, hi = max(start, offset), min(start + size, offset + width)
    if lo < hi:
      out.append((index, hi - lo))
    offset += width
  return out


class PiecesGroup:
  """Variables whose per-example gradients come as row-major [B, n] pieces (`Term.blocks`,
  `Joint.pieces`), reduced as they come: piece k (counted over all groups, `Pipeline`) is created
  once piece k - 2 is reduced, so that at most two (e.g. two kernel taps) are alive, and one
  is reduced while the next is computed. (One at a time left both CPU cores idle between
  them: on the small CNN's 9 taps of [128, 32, 64], 5.6 ms against 4.6 ms, for ~3 MiB.)"""

  def __init__(self, indices, pieces, variables):
    self.indices = tuple(indices)
    self._pieces = pieces
    self._widths = [(i, _width(variables[i])) for i in indices]

  def reduce(self, self_dots, pipeline):
    """Returns ({index: [[B, 1] squared norms]}, [[1, n] batch sums in order],
    [[B, 1] self-dots], kept pieces). `pipeline` (`Pipeline`) orders the pieces after those of
    the groups reduced before.

    Every reduction is a matrix product: the squared norms per variable are the squares times
    an indicator matrix of the variables' spans, the batch sum is ones times the piece, the
    self-dot the piece times that sum. On 2 CPU cores this is 3x faster than TF's elementwise
    reductions (`tf.reduce_sum`) of the same [B, n] pieces (7 pieces of [128, 1056], the text
    Transformer's layers: 0.34 ms against 1.13 ms), and it needs fewer ops.
    """
    parts, sums, dots, kept = {}, [], [], []
    iterator, start = iter(self._pieces), 0
    while True:
      with tf.control_dependencies(pipeline.previous):  # Piece k - 2's reductions.
        piece = next(iterator, None)
      if piece is None:
        return parts, sums, dots, kept
      piece = terms_lib.flat(piece)
      size = int(piece.shape[1])
      spans = _spans(self._widths, start, size)
      norms = tf.matmul(tf.square(piece), pipeline.indicator([w for _, w in spans]))
      columns = [norms] if len(spans) == 1 else tf.split(norms, len(spans), axis=1)
      for (index, _), column in zip(spans, columns):
        parts.setdefault(index, []).append(column)
      sums.append(tf.matmul(pipeline.ones_row(piece), piece))  # The column sums.
      done = [norms, sums[-1]]
      if self_dots:
        dots.append(_dots_with(piece, sums[-1]))
        done.append(dots[-1])
      else:
        kept.append(piece)
      pipeline.push(done)
      start += size

  def dots(self, kept, packed):
    """[B, 1] dots of the kept pieces with `packed` (this group's part of a packed gradient)."""
    out, offset = [], 0
    for piece in kept:
      width = int(piece.shape[1])
      out.append(_dots_with(piece, tf.reshape(packed[offset:offset + width], [1, width])))
      offset += width
    return tf.add_n(out)


class Pipeline:
  """The order of all materialised pieces, across groups: piece k is created once piece k - 2's
  reductions are done, and the first two once `after` (e.g. every recorded output gradient) is.

  Waiting for the whole backward pass keeps the pieces off the backward's peak. Without it the
  small CNN's unfolded conv1 input (which needs only the batch input) was computed during the
  forward pass and held through the backward, and the conv2 taps ran beside conv1's backward.
  B = 128, peak of TensorFlow's allocator: 48.1 -> 38.3 MiB, the batch gradient's 38.4 MiB.
  The text Transformer pays for holding all its recorded gradients until then: 4.0 -> 4.5 MiB
  (batch gradient 3.5 MiB); waiting only for each group's own gradient gave 42.0 and 4.0 MiB.
  It also holds the constants the reductions share (one graph node each, not one per piece).
  Traced or eager, any context; one per `combine` call (its tensors belong to that trace).
  """

  def __init__(self, after=()):
    self.previous, self._done = list(after), list(after)
    self._constants = {}  # One node per distinct constant (each node costs memory).

  def indicator(self, widths):
    """`_indicator(widths)`, shared by the pieces."""
    key = ("indicator",) + tuple(widths)
    if key not in self._constants:
      self._constants[key] = _indicator(widths)
    return self._constants[key]

  def ones_row(self, piece):
    """Ones [1, B] for a [B, n] piece, shared: ones times the piece is its column sums."""
    batch = piece.shape[0]
    key = ("ones", batch)
    if key not in self._constants:
      self._constants[key] = tf.ones(
          [1, batch if batch is not None else tf.shape(piece)[0]], piece.dtype)
    return self._constants[key]

  def push(self, done):
    """Records the reductions of the piece just made; the next piece waits for the ones before."""
    self.previous, self._done = self._done, list(done)


def combine(variables, groups, ghost, self_dots, after=()) -> GhostTerms:
  """GhostTerms from materialised groups (`PiecesGroup`) and ghost variables.

  Args:
    variables: all variables (defines V and the column order of `sq_norms`).
    groups: materialised groups, in packing order.
    ghost: {index: (term, dz)} for Gram/forward variables.
    self_dots: compute <g_i, sum_j g_j> now and keep nothing (see the module docstring).
    after: tensors the first pieces wait for (`Pipeline`).

  Tried and dropped (measured on the text Transformer, B=128): concatenating small pieces into
  one matrix (fewer ops, +11 MiB RSS for the copies); one product for layers reading the same
  input (MultiHeadAttention's query/key/value: fewer ops, +4 MiB RSS, no measurable gain).
  """
  order = [i for group in groups for i in group.indices] + sorted(ghost)
  sums, dots, kept, parts = [], [], [], {}
  pipeline = Pipeline(after)
  for group in groups:
    group_parts, group_sums, group_dots, state = group.reduce(self_dots, pipeline)
    for index, found in group_parts.items():
      parts.setdefault(index, []).extend(found)
    sums.extend(group_sums)
    dots.extend(group_dots)
    if not self_dots:
      kept.append((group, state, sum(_width(variables[i]) for i in group.indices)))
  for i in sorted(ghost):
    term, dz = ghost[i]
    parts[i] = [_column(term.gram_norms(dz))]
    total = term.batch_sum(dz)
    sums.append(tf.reshape(total, [1, -1]))
    if self_dots:
      dots.append(_column(term.dots(dz, total)))
  sq_norms = tf.concat([p[0] if len(p) == 1 else tf.add_n(p)
                        for p in (parts[i] for i in range(len(variables)))], axis=1)
  packed_sums = tf.reshape(sums[0] if len(sums) == 1 else tf.concat(sums, axis=1), [-1])
  return GhostTerms(variables, sq_norms, packed_sums, order,
                    None if self_dots else kept, {i: ghost[i] for i in sorted(ghost)},
                    tf.reshape(tf.add_n(dots), [-1]) if self_dots else None)


def variable_pieces(term_list, dzs, size, shape):
  """Row-major per-example pieces of one recorded variable (sum of its terms), lazily."""
  n = int(np.prod(shape))
  if len(term_list) == 1 and term_list[0].blocks is not None:
    yield from term_list[0].blocks(dzs[term_list[0].output])
  elif not term_list:  # Layer not called by this loss: zero gradient.
    yield tf.zeros(tf.stack([size, n]), tf.float32)
  else:
    grads = [t.grads(dzs[t.output]) for t in term_list]
    yield tf.reshape(grads[0] if len(grads) == 1 else tf.add_n(grads), [-1, n])


@autograph.library
def ghost_norms(rec, output_grads, *, general_grads=None, example_scale=None,
                batch_size=None, self_dots=False) -> GhostTerms:
  """Per-example squared norms for every variable of `rec.recorder`, without [B, P].

  Args:
    rec: the `recording.Recording` of the forward pass.
    output_grads: gradients of the loss w.r.t. `rec.outputs`, from the same backward pass.
    general_grads: [B, *shape] per `rec.recorder.general_variables` (required when any).
    example_scale: optional [B] c_i, see the module docstring.
    batch_size: B, needed only when a recorded variable's layer was not called at all and
      nothing else was recorded.
    self_dots: also compute `self_dots`, <g_i, sum_j g_j>, and keep nothing for `dots`.
  """
  recorder = rec.recorder
  general_grads = list(general_grads or [])
  if len(general_grads) != len(recorder.general_indices):
    raise ValueError(
        f"ghost_norms: {len(recorder.general_indices)} general-path variable(s) "
        f"({', '.join(v.path for v in recorder.general_variables)}) need `general_grads` from "
        f"`Recorder.general_gradients`; got {len(general_grads)} tensors.")
  dzs = _scaled(output_grads, example_scale)
  if example_scale is not None and general_grads:  # Rows with c_i = 0 report 0 here too.
    counted = tf.cast(tf.not_equal(tf.cast(example_scale, tf.float32), 0.0), tf.float32)
    general_grads = [tf.cast(g, tf.float32) * tf.reshape(counted, [-1] + [1] * (g.shape.rank - 1))
                     for g in general_grads]
  size = batch_size if rec.batch_size is None else rec.batch_size
  ghost = {i: (rec.terms[i][0], dzs[rec.terms[i][0].output]) for i in rec.ghost_indices()}
  variables = recorder.variables
  groups = [PiecesGroup((i,), [terms_lib.flat(g)], variables)
            for i, g in zip(recorder.general_indices, general_grads)]
  joints = {}
  for indices, joint in rec.joints:
    singles = all(len(rec.terms[i]) == 1 and rec.terms[i][0].output == joint.output
                  and i not in ghost for i in indices)
    if singles:
      joints.setdefault(indices[0], (indices, joint))
  grouped = set()
  for i in sorted(rec.terms):
    if i in ghost or i in grouped:
      continue
    if i in joints and not grouped.intersection(joints[i][0]):
      indices, joint = joints[i]
      groups.append(PiecesGroup(indices, joint.pieces(dzs[joint.output]), variables))
      grouped.update(indices)
    else:
      groups.append(PiecesGroup((i,), variable_pieces(rec.terms[i], dzs, size,
                                                      variables[i].shape), variables))
      grouped.add(i)
  return combine(variables, groups, ghost, self_dots, after=dzs)
