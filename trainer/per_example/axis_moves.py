"""Labels of where the examples are, and the rules of the ops that move axes.

`Examples(axis, inner, size)` and `MOVED` are the labels `axis_rules.py` and `labelling.py`
give tensors (see `axis_rules`). This module holds the rules of the ops that move the
examples' axis without mixing rows: Transpose, Reshape (the examples' stride in the flat
layout), StridedSlice and Slice, ExpandDims, Squeeze, Pack, Unpack, Concat and Split,
MatMul, BatchMatMul and Einsum (axes kept or contracted), SpaceToBatchND and BatchToSpaceND.
A rule is (op, input index, axis or label) -> the output's axis or label, or MOVED.

Context: Python only, while tracing (reads op attributes and constant inputs; creates no ops).
"""
import dataclasses
import math

import tensorflow as tf

MOVED = "moved"


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


def agreed(labels):
  """The one label that every label in `labels` (None, MOVED or Examples) can be, else MOVED.
  Examples that differ only where one size is unknown agree (a ragged batch's row splits made
  dense hold its B examples in order, sized only at run time), taking the known size."""
  labels = {a for a in labels if a is not None}
  if len(labels) <= 1:
    return labels.pop() if labels else None
  if MOVED in labels or len({(a.axis, a.inner) for a in labels}) != 1:
    return MOVED
  sizes = {a.size for a in labels} - {None}
  if len(sizes) > 1:
    return MOVED  # Two inputs disagree: rows are mixed.
  return dataclasses.replace(labels.pop(), size=sizes.pop() if sizes else None)


def static(t):
  """A tensor's value known while tracing, as a list (entries None where unknown), or None."""
  try:
    value = tf.get_static_value(t, partial=True)
  except (TypeError, ValueError):
    return None
  if value is None:
    return None
  return [None if v is None else int(v) for v in value.reshape([-1]).tolist()]


def normalized(values, rank):
  """Non-negative axes, or None when an axis or the rank is unknown."""
  if values is None or any(v is None for v in values):
    return None
  if any(v < 0 for v in values) and rank is None:
    return None
  return [v + rank if v < 0 else v for v in values]


def transpose(op, i, k):
  perm = static(op.inputs[1]) if i == 0 else None
  if perm is None or None in perm or k >= len(perm):
    return MOVED
  return perm.index(k)


def _bit(mask, position):
  return bool(mask >> position & 1)


def strided_slice(op, i, k):
  """The input axis k through a strided slice: where it lands, or MOVED when the slice takes
  some of its rows, reverses them or drops the axis."""
  rank = op.inputs[0].shape.rank
  if i != 0 or rank is None:
    return MOVED
  begin, end, strides = (static(op.inputs[j]) for j in (1, 2, 3))
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


def slice_(op, i, k):
  begin, size = static(op.inputs[1]), static(op.inputs[2])
  if i != 0 or begin is None or size is None or k >= len(begin):
    return MOVED
  full = op.inputs[0].shape[k]
  return k if begin[k] == 0 and (size[k] == -1 or (full is not None and size[k] == full)) else MOVED


def reshape(op, i, label):
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


def expand_dims(op, i, k):
  axis = normalized(static(op.inputs[1]), op.outputs[0].shape.rank) if i == 0 else None
  if axis is None:
    return MOVED
  return k + 1 if axis[0] <= k else k


def squeeze(op, i, k):
  shape = op.inputs[0].shape
  if i != 0 or shape.rank is None:
    return MOVED
  dims = normalized(list(op.get_attr("squeeze_dims")), shape.rank)
  if not dims:
    if None in shape[:k + 1].as_list():
      return MOVED
    dims = [d for d in range(shape.rank) if shape[d] == 1]
  return MOVED if k in dims else k - sum(1 for d in dims if d < k)


def pack(op, i, k):
  del i
  axis = normalized([op.get_attr("axis")], op.outputs[0].shape.rank)
  if axis is None:
    return MOVED
  return k + 1 if axis[0] <= k else k


def unpack(op, i, k):
  del i
  axis = normalized([op.get_attr("axis")], op.inputs[0].shape.rank)
  if axis is None or axis[0] == k:
    return MOVED
  return k - 1 if axis[0] < k else k


def along_axis(value_input, axis_input):
  """Concat or split: MOVED along the examples' own axis, else the axis is kept."""
  def rule(op, i, k):
    axis_input_index = axis_input if axis_input >= 0 else len(op.inputs) + axis_input
    if i == axis_input_index or (value_input is not None and i != value_input):
      return MOVED
    axis = normalized(static(op.inputs[axis_input_index]), op.outputs[0].shape.rank)
    return MOVED if axis is None or axis[0] == k else k
  return rule


def matmul(op, i, k):
  if i == 0:
    kept = 1 if op.get_attr("transpose_a") else 0
    return 0 if k == kept else MOVED  # Contracted over the examples: mixed.
  kept = 0 if op.get_attr("transpose_b") else 1
  return 1 if k == kept else MOVED


def batch_matmul(op, i, k):
  rank, out_rank = op.inputs[i].shape.rank, op.outputs[0].shape.rank
  if rank is None or out_rank is None:
    return MOVED
  if k < rank - 2:
    return k + out_rank - rank  # Batch dimensions broadcast from the right.
  if i == 0:
    rows = rank - 1 if op.get_attr("adj_x") else rank - 2
    return out_rank - 2 if k == rows else MOVED
  columns = rank - 2 if op.get_attr("adj_y") else rank - 1
  return out_rank - 1 if k == columns else MOVED


def _labels(spec, rank, ellipsis_rank):
  """Einsum subscripts of one operand as one label per axis (ellipsis axes as ('...', j),
  aligned from the right against the output's `ellipsis_rank` ellipsis axes)."""
  if "..." not in spec:
    return list(spec)
  left, right = spec.split("...")
  own = rank - len(left) - len(right)
  return (list(left) + [("...", j + ellipsis_rank - own) for j in range(own)] + list(right))


def einsum(op, i, k):
  equation = op.get_attr("equation")
  equation = equation.decode() if isinstance(equation, bytes) else equation
  equation = equation.replace(" ", "")
  if "->" not in equation:
    return MOVED
  inputs, output = equation.split("->")
  specs = inputs.split(",")
  ranks = [t.shape.rank for t in op.inputs]
  if None in ranks or len(specs) != len(ranks):
    return MOVED
  ellipsis_rank = max([r - len(s.replace("...", "")) for s, r in zip(specs, ranks) if "..." in s]
                      or [0])
  label = _labels(specs[i], ranks[i], ellipsis_rank)[k]
  out_labels = _labels(output, len(output.replace("...", "")) + ellipsis_rank, ellipsis_rank)
  return out_labels.index(label) if label in out_labels else MOVED


def space_to_batch(op, i, label):
  """SpaceToBatchND (TF's dilated convolutions) moves blocks of positions into axis 0, block by
  block: index j of the result belongs to example j % B. BatchToSpaceND puts them back."""
  if i != 0 or not label.in_order:
    return MOVED
  return Examples(0, 1, label.size)
