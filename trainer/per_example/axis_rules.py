"""Where the example axis of a tensor goes through one TensorFlow op of a traced graph.

The walk of `labelling.py` (for `examples_axis.py`) labels each tensor of a traced forward pass
with where the batch's examples are in it:
* `None`: the tensor does not depend on the batch's values, or only through an aggregate over
  the examples (a reduction or contraction over their axis: one value shared by all of them);
* `Examples(axis, inner, size)`: along `axis`, index j belongs to example (j // inner) % size
  (the batch's own tensors: `Examples(0, 1, B)`; a [B*T, F] reshape of [B, T, F]:
  `Examples(0, T, B)`, which a later reshape back to [B, T, O] returns to `Examples(0, 1, B)`);
* `MOVED`: it depends on the batch but no axis is the examples in order (x[::-1], a gather or a
  shuffle of the rows, a transpose whose permutation is unknown).
`output_label(op, labels)` maps the labels of an op's inputs to the label of its outputs. Ops
that move axes (Transpose, ExpandDims, Pack, Einsum, MatMul, Reshape, ...) or rows (ReverseV2,
Gather over the examples, slices with a stride, Roll, ...) have a rule here; every other op
keeps the axis of its inputs (elementwise ops, convolutions, pooling, casts, nested function
calls, ...). Broadcasting elementwise ops align their inputs from the right, as TensorFlow does.
A constant operand a rule needs (a permutation, an axis, a static shape) that is not known
while tracing gives `MOVED`: the caller then takes the exact, slower path.

Context: Python only, while tracing (reads op attributes and constant inputs; creates no ops).
"""
import dataclasses
import math

from absl import logging
import tensorflow as tf

MOVED = "moved"

# Elementwise ops that broadcast their operands from the right.
_BROADCASTING = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "FloorDiv", "FloorMod", "Mod",
    "Maximum", "Minimum", "Pow", "SquaredDifference", "SelectV2", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "BroadcastTo",
    "MulNoNan", "Xdivy", "Xlogy", "Atan2", "BitwiseAnd", "BitwiseOr", "BitwiseXor"})
_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"})
_ROWS_OF_AXIS_ZERO_MIXED = frozenset({"RandomShuffle", "ScatterNd",
                                      "TensorScatterUpdate", "TensorScatterAdd",
                                      "TensorScatterSub", "TensorScatterMax", "TensorScatterMin",
                                      "TensorListPopBack", "TensorListGather",
                                      "TensorListScatter", "TensorListScatterV2",
                                      "TensorListScatterIntoExistingList", "TensorListConcat",
                                      "TensorListConcatV2", "TensorListSplit"})


@dataclasses.dataclass(frozen=True)
class Examples:
  """Index j along `axis` belongs to example (j // inner) % size (`size` None if unknown)."""
  axis: int
  inner: int = 1
  size: int | None = None

  @property
  def in_order(self) -> bool:
    """Whether `axis` 0 holds the examples, one row each (given one row per example)."""
    return self.axis == 0 and self.inner == 1


def output_label(op, labels):
  """The label (see the module docstring) of `op`'s outputs, given its inputs' labels."""
  live = [(i, a) for i, a in enumerate(labels) if a is not None]
  if not live:
    return None
  if any(a == MOVED for _, a in live) or op.type in _ROWS_OF_AXIS_ZERO_MIXED:
    return MOVED
  rule = _RULES.get(op.type, _broadcast if op.type in _BROADCASTING else _same)
  found = set()
  for i, label in live:
    try:
      if op.type in _WHOLE_LABEL_RULES:
        found.add(_WHOLE_LABEL_RULES[op.type](op, i, label))
        continue
      axis = rule(op, i, label.axis)
    except (ValueError, TypeError, IndexError, AttributeError) as e:  # An op unlike its rule's.
      logging.debug("per_example: no axis rule applies to %s (%s)", op.name, e)
      axis = MOVED
    found.add(axis if axis in (None, MOVED) else dataclasses.replace(label, axis=axis))
  found.discard(None)
  if not found:
    return None
  return found.pop() if len(found) == 1 else MOVED  # Two inputs disagree: rows are mixed.


def _rank(t):
  return t.shape.rank


def _static(t):
  """A tensor's value known while tracing, as a list (entries None where unknown), or None."""
  try:
    value = tf.get_static_value(t, partial=True)
  except (TypeError, ValueError):
    return None
  if value is None:
    return None
  return [None if v is None else int(v) for v in value.reshape([-1]).tolist()]


def _normalized(values, rank):
  """Non-negative axes, or None when an axis or the rank is unknown."""
  if values is None or any(v is None for v in values):
    return None
  if any(v < 0 for v in values) and rank is None:
    return None
  return [v + rank if v < 0 else v for v in values]


def _same(op, i, k):
  del op, i
  return k


def _broadcast(op, i, k):
  out_rank, in_rank = _rank(op.outputs[0]), _rank(op.inputs[i])
  if out_rank is None or in_rank is None:
    return k
  return k + out_rank - in_rank


def _transpose(op, i, k):
  perm = _static(op.inputs[1]) if i == 0 else None
  if perm is None or None in perm or k >= len(perm):
    return MOVED
  return perm.index(k)


def _axes_rule(axes_input):
  """Ops that move the rows along the axes in input `axes_input` (ReverseV2, Roll)."""
  def rule(op, i, k):
    axes = _normalized(_static(op.inputs[axes_input]), _rank(op.inputs[0])) if i == 0 else None
    return MOVED if axes is None or k in axes else k
  return rule


def _reverse_sequence(op, i, k):
  if i == 0:
    return MOVED if k == op.get_attr("seq_dim") else k
  return op.get_attr("batch_dim") if k == 0 else MOVED  # The lengths, one per batch row.


def _gather(op, i, k):
  """GatherV2(params, indices, axis)."""
  batch_dims = op.get_attr("batch_dims")
  axis = _normalized(_static(op.inputs[2]), _rank(op.inputs[0]))
  if i == 2 or axis is None:
    return MOVED
  axis = axis[0]
  if k < batch_dims:
    return k
  if i == 1:  # Indices: their axes replace params' `axis`.
    return axis + k - batch_dims
  if k == axis:
    return MOVED  # Rows picked from the examples' axis: any order.
  indices_rank = _rank(op.inputs[1])
  if k < axis:
    return k
  return MOVED if indices_rank is None else k + indices_rank - batch_dims - 1


def _gather_nd(op, i, k):
  if i == 0:
    return k if k < op.get_attr("batch_dims") else MOVED
  rank = _rank(op.inputs[1])
  return k if rank is not None and k < rank - 1 else MOVED


def _bit(mask, position):
  return bool(mask >> position & 1)


def _strided_slice(op, i, k):
  """The input axis k through a strided slice: where it lands, or MOVED when the slice takes
  some of its rows, reverses them or drops the axis."""
  rank = _rank(op.inputs[0])
  if i != 0 or rank is None:
    return MOVED
  begin, end, strides = (_static(op.inputs[j]) for j in (1, 2, 3))
  if begin is None or end is None or strides is None:
    return MOVED
  get = op.get_attr
  masks = {name: get(name) for name in ("begin_mask", "end_mask", "ellipsis_mask",
                                        "new_axis_mask", "shrink_axis_mask")}
  entries = len(strides)
  consumed = sum(1 for e in range(entries) if not _bit(masks["ellipsis_mask"], e)
                 and not _bit(masks["new_axis_mask"], e))
  dim, out = 0, 0
  for e in range(entries):
    if _bit(masks["ellipsis_mask"], e):
      covered = rank - consumed
      if dim <= k < dim + covered:
        return out + k - dim
      dim, out = dim + covered, out + covered
    elif _bit(masks["new_axis_mask"], e):
      out += 1
    elif dim == k:
      if _bit(masks["shrink_axis_mask"], e) or strides[e] != 1:
        return MOVED
      size = op.inputs[0].shape[k]
      starts_at_zero = _bit(masks["begin_mask"], e) or begin[e] == 0
      ends_at_end = _bit(masks["end_mask"], e) or (
          end[e] is not None and size is not None and end[e] >= size)
      return out if starts_at_zero and ends_at_end else MOVED
    else:
      dim, out = dim + 1, out + (0 if _bit(masks["shrink_axis_mask"], e) else 1)
  return out + k - dim  # Past the spec: axes kept as they are.


def _slice(op, i, k):
  begin, size = _static(op.inputs[1]), _static(op.inputs[2])
  if i != 0 or begin is None or size is None or k >= len(begin):
    return MOVED
  full = op.inputs[0].shape[k]
  return k if begin[k] == 0 and (size[k] == -1 or (full is not None and size[k] == full)) else MOVED


def _reshape(op, i, label):
  """A reshape keeps the elements' row-major order: the examples stay at the same stride of
  the flat layout, inner * prod(dims after their axis), and land on the output axis whose
  trailing product divides that stride. Unknown sizes: rows of axis 0 survive a reshape that
  keeps axis 0's size (a different size is caught where a layer reads it: the rows check)."""
  if i != 0:
    return MOVED
  before, after = op.inputs[0].shape, op.outputs[0].shape
  dims_in = before.as_list() if before.rank is not None else None
  dims_out = after.as_list() if after.rank is not None else None
  if (dims_in is None or dims_out is None or None in dims_in or None in dims_out
      or label.size is None):
    return label if label.axis == 0 else MOVED
  stride = label.inner * math.prod(dims_in[label.axis + 1:])
  for axis in range(len(dims_out)):
    trailing = math.prod(dims_out[axis + 1:])
    if stride % trailing == 0 and dims_out[axis] % (stride // trailing * label.size) == 0:
      return Examples(axis, stride // trailing, label.size)
  return MOVED


def _expand_dims(op, i, k):
  axis = _normalized(_static(op.inputs[1]), _rank(op.outputs[0])) if i == 0 else None
  if axis is None:
    return MOVED
  return k + 1 if axis[0] <= k else k


def _squeeze(op, i, k):
  shape = op.inputs[0].shape
  if i != 0 or shape.rank is None:
    return MOVED
  dims = _normalized(list(op.get_attr("squeeze_dims")), shape.rank)
  if not dims:
    if None in shape[:k + 1].as_list():
      return MOVED
    dims = [d for d in range(shape.rank) if shape[d] == 1]
  return MOVED if k in dims else k - sum(1 for d in dims if d < k)


def _pack(op, i, k):
  del i
  axis = _normalized([op.get_attr("axis")], _rank(op.outputs[0]))
  if axis is None:
    return MOVED
  return k + 1 if axis[0] <= k else k


def _unpack(op, i, k):
  del i
  axis = _normalized([op.get_attr("axis")], _rank(op.inputs[0]))
  if axis is None or axis[0] == k:
    return MOVED
  return k - 1 if axis[0] < k else k


def _along_axis(value_input, axis_input):
  """Concat or split: MOVED along the examples' own axis, else the axis is kept."""
  def rule(op, i, k):
    axis_input_index = axis_input if axis_input >= 0 else len(op.inputs) + axis_input
    if i == axis_input_index or (value_input is not None and i != value_input):
      return MOVED
    axis = _normalized(_static(op.inputs[axis_input_index]), _rank(op.outputs[0]))
    return MOVED if axis is None or axis[0] == k else k
  return rule


def _tile(op, i, k):
  multiples = _static(op.inputs[1]) if i == 0 else None
  if multiples is None or k >= len(multiples) or multiples[k] != 1:
    return MOVED
  return k


def _reduction(op, i, k):
  rank = _rank(op.inputs[0])
  axes = _normalized(_static(op.inputs[1]), rank) if i == 0 else None
  if axes is None:
    return MOVED
  if k in axes:
    return None  # An aggregate over the examples: shared by all of them.
  return k if op.get_attr("keep_dims") else k - sum(1 for a in axes if a < k)


def _arg_reduction(op, i, k):
  axis = _normalized(_static(op.inputs[1]), _rank(op.inputs[0])) if i == 0 else None
  if axis is None:
    return MOVED
  return None if axis[0] == k else (k - 1 if axis[0] < k else k)


def _matmul(op, i, k):
  if i == 0:
    kept = 1 if op.get_attr("transpose_a") else 0
    return 0 if k == kept else None  # Contracted over the examples: an aggregate.
  kept = 0 if op.get_attr("transpose_b") else 1
  return 1 if k == kept else None


def _batch_matmul(op, i, k):
  rank, out_rank = _rank(op.inputs[i]), _rank(op.outputs[0])
  if rank is None or out_rank is None:
    return MOVED
  if k < rank - 2:
    return k + out_rank - rank  # Batch dimensions broadcast from the right.
  if i == 0:
    rows = rank - 1 if op.get_attr("adj_x") else rank - 2
    return out_rank - 2 if k == rows else None
  columns = rank - 2 if op.get_attr("adj_y") else rank - 1
  return out_rank - 1 if k == columns else None


def _labels(spec, rank, ellipsis_rank):
  """Einsum subscripts of one operand as one label per axis (ellipsis axes as ('...', j),
  aligned from the right against the output's `ellipsis_rank` ellipsis axes)."""
  if "..." not in spec:
    return list(spec)
  left, right = spec.split("...")
  own = rank - len(left) - len(right)
  return (list(left) + [("...", j + ellipsis_rank - own) for j in range(own)] + list(right))


def _einsum(op, i, k):
  equation = op.get_attr("equation")
  equation = equation.decode() if isinstance(equation, bytes) else equation
  equation = equation.replace(" ", "")
  if "->" not in equation:
    return MOVED
  inputs, output = equation.split("->")
  specs = inputs.split(",")
  ranks = [_rank(t) for t in op.inputs]
  if None in ranks or len(specs) != len(ranks):
    return MOVED
  ellipsis_rank = max([r - len(s.replace("...", "")) for s, r in zip(specs, ranks) if "..." in s]
                      or [0])
  label = _labels(specs[i], ranks[i], ellipsis_rank)[k]
  out_labels = _labels(output, len(output.replace("...", "")) + ellipsis_rank, ellipsis_rank)
  return out_labels.index(label) if label in out_labels else None


def _space_to_batch(op, i, label):
  """SpaceToBatchND (TF's dilated convolutions) moves blocks of positions into axis 0, block by
  block: index j of the result belongs to example j % B. BatchToSpaceND puts them back."""
  if i != 0 or not label.in_order:
    return MOVED
  return Examples(0, 1, label.size)


def _list_item(op, i, k):
  """TensorListGetItem(list, index, shape): an element drops the list's axis 0."""
  if i != 0 or k == 0:
    return MOVED  # One element per example: one example's values.
  return k - 1


def _list_set(op, i, k):
  """TensorListSetItem(list, index, item) and TensorListPushBack(list, item): the item's axes
  come after the list's axis 0 (an index from the batch's values: MOVED)."""
  if i == 0:
    return k
  return k + 1 if i == len(op.inputs) - 1 else MOVED


_RULES = {
    "Transpose": _transpose, "ConjugateTranspose": _transpose,
    "ReverseV2": _axes_rule(1), "Roll": _axes_rule(2), "ReverseSequence": _reverse_sequence,
    "GatherV2": _gather, "GatherNd": _gather_nd,
    "StridedSlice": _strided_slice, "Slice": _slice,
    "ExpandDims": _expand_dims, "Squeeze": _squeeze, "Pack": _pack, "Unpack": _unpack,
    "ConcatV2": _along_axis(None, -1), "Split": _along_axis(1, 0), "SplitV": _along_axis(0, 2),
    "Tile": _tile, "ArgMax": _arg_reduction, "ArgMin": _arg_reduction,
    "MatMul": _matmul, "BatchMatMul": _batch_matmul, "BatchMatMulV2": _batch_matmul,
    "BatchMatMulV3": _batch_matmul, "Einsum": _einsum,
    "TensorListGetItem": _list_item, "TensorListSetItem": _list_set,
    "TensorListPushBack": _list_set,
    **{name: _reduction for name in _REDUCTIONS},
}
# Rules that read the whole label (the examples' stride), not only their axis.
_WHOLE_LABEL_RULES = {"Reshape": _reshape, "SpaceToBatchND": _space_to_batch,
                      "BatchToSpaceND": _space_to_batch, "SpaceToBatch": _space_to_batch,
                      "BatchToSpace": _space_to_batch}
