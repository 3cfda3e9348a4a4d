"""Where the example axis of a tensor goes through one TensorFlow op of a traced graph.

The walk of `labelling.py` (for `examples_axis.py`) labels each tensor of a traced forward pass
with where the batch's examples are in it:
* `None`: the tensor does not depend on the batch's values;
* `Examples(axis, inner, size)`: along `axis`, index j belongs to example (j // inner) % size
  (the batch's own tensors: `Examples(0, 1, B)`; a [B*T, F] reshape of [B, T, F]:
  `Examples(0, T, B)`, which a later reshape back to [B, T, O] returns to `Examples(0, 1, B)`);
* `MOVED`: it depends on the batch but no axis holds the examples in order, each row from its
  own example alone: rows reordered (x[::-1], a gather, sort or shuffle of the rows) or mixed
  across examples (a sum, mean, cumsum, pooling or matrix product over the examples' axis,
  `x - mean(x, 0)`: per-example gradients then differ from one example's own, which the general
  path computes), or a transpose whose permutation is unknown.
`output_label(op, labels)` maps the labels of an op's inputs to the label of its outputs. Ops
that move axes (Transpose, ExpandDims, Pack, Einsum, MatMul, Reshape, ...) or rows (ReverseV2,
Gather over the examples, slices with a stride, Roll, sorts, ...) have a rule here, and so do
ops that work along some axes (convolutions, pooling, softmax, cumsum, padding, resizing);
elementwise ops keep the axis of their inputs, broadcasting ones aligned from the right as
TensorFlow does. Every other op gives `MOVED` (an allowlist: an op nobody checked sends the
layers after it to the exact, slower general path, and its name appears in the message), as
does a constant operand a rule needs (a permutation, an axis, a static shape) that is not
known while tracing.

Context: Python only, while tracing (reads op attributes and constant inputs; creates no ops).
"""
import dataclasses

from absl import logging

from trainer.per_example import axis_moves as moves

MOVED = moves.MOVED
Examples = moves.Examples

# Elementwise ops that broadcast their operands from the right.
_BROADCASTING = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "FloorDiv", "FloorMod", "Mod",
    "Maximum", "Minimum", "Pow", "SquaredDifference", "SelectV2", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "BroadcastTo",
    "MulNoNan", "Xdivy", "Xlogy", "Atan2", "BitwiseAnd", "BitwiseOr", "BitwiseXor"})
_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"})
# Elementwise ops with one data operand (or several of the same shape): they keep every axis.
_ELEMENTWISE = frozenset({
    "Identity", "StopGradient", "PreventGradient", "Snapshot", "CheckNumerics", "EnsureShape",
    "Cast", "Bitcast", "Neg", "Abs", "Sign", "Reciprocal", "Inv", "Square", "Sqrt", "Rsqrt",
    "Exp", "Expm1", "Log", "Log1p", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh",
    "Tanh", "Asinh", "Acosh", "Atanh", "Erf", "Erfc", "Erfinv", "Lgamma", "Digamma", "Floor",
    "Ceil", "Round", "Rint", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Gelu", "Softplus",
    "Softsign", "Sigmoid", "IsNan", "IsInf", "IsFinite", "LogicalNot", "ZerosLike", "OnesLike",
    "Real", "Imag", "Conj", "ComplexAbs", "Angle", "ClipByValue", "AddN", "Select",
    "TensorListFromTensor", "TensorListStack", "FakeQuantWithMinMaxArgs", "BesselI0e",
    "BesselI1e", "Sinc",
    "Bucketize", "StringToHashBucketFast", "StringToHashBucketStrong", "StringToNumber",
    "RaggedTensorToTensor", "SparseToDense"})  # (Rows from a ragged or sparse batch's parts.)
# Ops that read NHWC-style data: axis 0 row by row, the other axes mixed.
_BATCH_AXIS_OPS = ("Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2dNative", "MaxPool", "MaxPoolV2",
                   "AvgPool", "MaxPool3D", "AvgPool3D", "ResizeBilinear", "ResizeNearestNeighbor",
                   "ResizeBicubic", "ResizeArea", "ScaleAndTranslate", "LRN",
                   "ExtractImagePatches", "DepthToSpace", "SpaceToDepth",
                   "ImageProjectiveTransformV2", "ImageProjectiveTransformV3")
_ROWS_OF_AXIS_ZERO_MIXED = frozenset({  # Rows of the examples' axis moved or mixed.
    "RandomShuffle", "ScatterNd", "TensorScatterUpdate", "TensorScatterAdd", "TensorScatterSub",
    "TensorScatterMax", "TensorScatterMin", "TensorListPopBack", "TensorListGather",
    "TensorListScatter", "TensorListScatterV2", "TensorListScatterIntoExistingList",
    "TensorListConcat", "TensorListConcatV2", "TensorListSplit", "Unique", "UniqueV2",
    "UniqueWithCounts", "DynamicPartition", "DynamicStitch", "ParallelDynamicStitch"})


def output_label(op, labels):
  """The label (see the module docstring) of `op`'s outputs, given its inputs' labels."""
  live = [(i, a) for i, a in enumerate(labels) if a is not None]
  if not live:
    return None
  if any(a == MOVED for _, a in live) or op.type in _ROWS_OF_AXIS_ZERO_MIXED:
    return MOVED
  whole = _WHOLE_LABEL_RULES.get(op.type)
  rule = _RULES.get(op.type) or (_broadcast if op.type in _BROADCASTING else
                                  _same if op.type in _ELEMENTWISE else _no_rule)
  found = set()
  for i, label in live:
    try:
      if whole is not None:
        found.add(whole(op, i, label))
        continue
      axis = rule(op, i, label.axis)
    except (ValueError, TypeError, IndexError, AttributeError) as e:  # An op unlike its rule's.
      logging.debug("per_example: no axis rule applies to %s (%s)", op.name, e)
      axis = MOVED
    found.add(axis if axis in (None, MOVED) else dataclasses.replace(label, axis=axis))
  return moves.agreed(found)  # Two inputs that disagree mix the rows: MOVED.


def _same(op, i, k):  # pylint: disable=unused-argument
  return k


def _broadcast(op, i, k):
  out_rank, in_rank = op.outputs[0].shape.rank, op.inputs[i].shape.rank
  if out_rank is None or in_rank is None:
    return k
  return k + out_rank - in_rank


def _axes_rule(axes_input):
  """Ops that move the rows along the axes in input `axes_input` (ReverseV2, Roll)."""
  def rule(op, i, k):
    if i != 0:
      return MOVED
    axes = moves.normalized(moves.static(op.inputs[axes_input]), op.inputs[0].shape.rank)
    return MOVED if axes is None or k in axes else k
  return rule


def _along_last_axis(axes=1):
  """Ops along the last `axes` axes (TopKV2 for `tf.sort`, Softmax, MatrixBandPart): they
  reorder or mix the examples when those are there."""
  def rule(op, i, k):
    rank = op.inputs[0].shape.rank
    if i != 0 or rank is None:
      return MOVED
    return MOVED if k >= rank - axes else k
  return rule


def _data_input(data, batch_axis_only=False):
  """Ops that read one data input row by row; other inputs (a filter, a bias) that depend on
  the batch mix it. Convolutions, pooling and resizing (`batch_axis_only`) also mix every axis
  but the batch axis."""
  def rule(op, i, k):
    if i != data or (batch_axis_only and k != 0):
      return MOVED
    return k
  return rule


def _pad(op, i, k):
  paddings = moves.static(op.inputs[1]) if i == 0 else None
  if paddings is None or 2 * k + 1 >= len(paddings):
    return MOVED
  return k if paddings[2 * k] == 0 and paddings[2 * k + 1] == 0 else MOVED


def _one_hot(op, i, k):
  axis = op.get_attr("axis")
  if i != 0:
    return MOVED
  return k + 1 if 0 <= axis <= k else k


def _no_rule(op, i, k):  # pylint: disable=unused-argument
  return MOVED


def _row_by_row(op, i, k):  # pylint: disable=unused-argument
  """Ops over [B, C] rows (softmax cross-entropy: logits, labels -> loss [B], backprop
  [B, C]): the examples stay on axis 0; on the class axis they are mixed."""
  return 0 if k == 0 else MOVED


def _reverse_sequence(op, i, k):
  if i == 0:
    return MOVED if k == op.get_attr("seq_dim") else k
  return op.get_attr("batch_dim") if k == 0 else MOVED  # The lengths, one per batch row.


def _gather(op, i, k):
  """GatherV2(params, indices, axis)."""
  batch_dims = op.get_attr("batch_dims")
  axis = moves.normalized(moves.static(op.inputs[2]), op.inputs[0].shape.rank)
  if i == 2 or axis is None:
    return MOVED
  axis = axis[0]
  if k < batch_dims:
    return k
  if i == 1:  # Indices: their axes replace params' `axis`.
    return axis + k - batch_dims
  if k == axis:
    return MOVED  # Rows picked from the examples' axis: any order.
  indices_rank = op.inputs[1].shape.rank
  if k < axis:
    return k
  return MOVED if indices_rank is None else k + indices_rank - batch_dims - 1


def _gather_nd(op, i, k):
  if i == 0:
    return k if k < op.get_attr("batch_dims") else MOVED
  rank = op.inputs[1].shape.rank
  return k if rank is not None and k < rank - 1 else MOVED


def _tile(op, i, k):
  multiples = moves.static(op.inputs[1]) if i == 0 else None
  if multiples is None or k >= len(multiples) or multiples[k] != 1:
    return MOVED
  return k


def _reduction(op, i, k):
  rank = op.inputs[0].shape.rank
  axes = moves.normalized(moves.static(op.inputs[1]), rank) if i == 0 else None
  if axes is None:
    return MOVED
  if k in axes:
    return MOVED  # An aggregate over the examples: mixes them.
  return k if op.get_attr("keep_dims") else k - sum(1 for a in axes if a < k)


def _arg_reduction(op, i, k):
  if i != 0:
    return MOVED
  axis = moves.normalized(moves.static(op.inputs[1]), op.inputs[0].shape.rank)
  if axis is None:
    return MOVED
  return MOVED if axis[0] == k else (k - 1 if axis[0] < k else k)


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
    "Transpose": moves.transpose, "ConjugateTranspose": moves.transpose,
    "ReverseV2": _axes_rule(1), "Roll": _axes_rule(2), "ReverseSequence": _reverse_sequence,
    "GatherV2": _gather, "GatherNd": _gather_nd,
    "StridedSlice": moves.strided_slice, "Slice": moves.slice_,
    "ExpandDims": moves.expand_dims, "Squeeze": moves.squeeze, "Pack": moves.pack,
    "Unpack": moves.unpack, "ConcatV2": moves.along_axis(None, -1),
    "Split": moves.along_axis(1, 0), "SplitV": moves.along_axis(0, 2),
    "Tile": _tile, "ArgMax": _arg_reduction, "ArgMin": _arg_reduction,
    "MatMul": moves.matmul, "Einsum": moves.einsum,
    **{name: moves.batch_matmul for name in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")},
    "TopKV2": _along_last_axis(), "NthElement": _along_last_axis(),
    "Softmax": _along_last_axis(), "LogSoftmax": _along_last_axis(),
    "MatrixBandPart": _along_last_axis(2), "BiasAdd": _data_input(0),
    "SparseSoftmaxCrossEntropyWithLogits": _row_by_row,
    "SoftmaxCrossEntropyWithLogits": _row_by_row,
    "LookupTableFindV2": _data_input(1),  # (StringLookup, IntegerLookup: keys.)
    **{f"{kind}FFT{name}": _along_last_axis(axes) for kind in ("", "I", "R", "IR")
       for name, axes in (("", 1), ("2D", 2), ("3D", 3))},
    "Cumsum": _axes_rule(1), "Cumprod": _axes_rule(1), "CumulativeLogsumexp": _axes_rule(1),
    "Pad": _pad, "PadV2": _pad, "MirrorPad": _pad, "OneHot": _one_hot,
    **{name: _data_input(0, batch_axis_only=True) for name in _BATCH_AXIS_OPS},
    "Conv2DBackpropInput": _data_input(2, batch_axis_only=True),
    "Conv3DBackpropInputV2": _data_input(2, batch_axis_only=True),
    "TensorListGetItem": _list_item, "TensorListSetItem": _list_set,
    "TensorListPushBack": _list_set,
    **{name: _reduction for name in _REDUCTIONS},
}
# Rules that read the whole label (the examples' stride), not only their axis.
_WHOLE_LABEL_RULES = {"Reshape": moves.reshape, **{
    name: moves.space_to_batch
    for name in ("SpaceToBatchND", "BatchToSpaceND", "SpaceToBatch", "BatchToSpace")}}
