"""Labels where the batch's examples are in each tensor of a traced graph (`axis_rules` labels).

`Labeller(seeds).label(t)` walks the graph back from `t` through op inputs to the seed tensors
(the batch's, labelled `Examples(0, 1, B)`), then forward again applying `axis_rules` op by op.
* Ops that read only a shape (`Shape`, `Size`, ...) give `None`: a tensor made from the batch's
  shape alone (`arange(shape(x)[1])` position ids) holds no per-example values.
* A placeholder of a nested function graph takes the label of the outer tensor it captures.
* Function-call ops (`PartitionedCall`, `If`, `While` and their stateful and stateless forms)
  are labelled output by output by walking their function graphs with their inputs' labels;
  a loop's body is walked until its loop variables' labels stop changing (an RNN's state starts
  as zeros, independent of the batch, and holds the examples in order after one step).
  A function graph that cannot be read gives each output its inputs' common label.

Each label comes with `via`: the op that last moved the examples ('' when none did), named in
the messages. Memoised per op across calls of one `Labeller`.

Context: Python only, while tracing or on a finished graph; creates no ops.
"""
from absl import logging
import tensorflow as tf

from trainer.per_example import axis_moves
from trainer.per_example import axis_rules

MOVED = axis_rules.MOVED
# Ops whose outputs carry the shape of their input, not its values.
SHAPE_ONLY = frozenset({"Shape", "ShapeN", "Size", "Rank"})
_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
_BRANCHES = frozenset({"If", "StatelessIf"})
_LOOPS = frozenset({"While", "StatelessWhile"})
_LOOP_PASSES = 8  # Labels only grow (None -> Examples -> MOVED): a few passes settle them.


def join(a, b):
  """The label of a value that may be either `a` or `b`."""
  return axis_moves.agreed([a, b])


class Labeller:
  """Labels the tensors of one graph (and the graphs nested in it) from labelled seeds."""

  def __init__(self, seeds):
    """`seeds`: {tensor.ref(): label}."""
    self._seeds = dict(seeds)
    self._labels = {}  # op -> [(label, via)] per output.

  def label(self, tensor):
    """(label, via) of `tensor` (eager tensors: (None, ''))."""
    stack, visiting = [tensor], set()
    while stack:
      t = stack[-1]
      if self._known(t) is not None:
        stack.pop()
        continue
      op = t.op
      sources, copies = _sources(t)
      pending = [s for s in sources if self._known(s) is None and s.op not in visiting]
      if pending and op not in visiting:
        visiting.add(op)
        stack.extend(pending)
        continue
      stack.pop()
      found = [self._known(s) or (None, "") for s in sources]  # (A cycle reads as independent.)
      self._labels[op] = ([found[0] if found else (None, "")] if copies
                          else self._op_labels(op, found))
    return self._known(tensor)

  def _known(self, t):
    if t.ref() in self._seeds:
      return (self._seeds[t.ref()], "")
    if isinstance(t, tf.__internal__.EagerTensor):
      return (None, "")
    found = self._labels.get(t.op)
    return None if found is None else found[min(t.value_index, len(found) - 1)]

  def _op_labels(self, op, found):
    if op.type == "IdentityN":  # (tf.custom_gradient's outputs.) Output j is input j.
      return list(found) or [(None, "")]
    if op.type in _CALLS | _BRANCHES | _LOOPS:
      nested = _nested_labels(op, found)
      if nested is not None:
        return nested
    label = axis_rules.output_label(op, [axis for axis, _ in found])
    return [_with_via(op, label, found)]


def _with_via(op, label, found):
  carried = [via for axis, via in found if axis == label and axis is not None]
  if carried:
    return (label, carried[0])
  in_order = isinstance(label, axis_rules.Examples) and label.in_order
  return (label, "" if in_order or label is None else f"{op.type} {op.name!r}")


def _sources(t):
  """(The tensors whose labels decide the labels of `t`'s op, whether the op just takes its one
  source's label: a placeholder of a nested function copies the tensor it captures, an op
  that reads only a shape has no source and is independent of the batch's values.)"""
  external = _captured(t)
  if external is not None:
    return [external], True
  if t.op.type in SHAPE_ONLY:
    return [], True
  return list(t.op.inputs), False


def _captured(t):
  """The outer tensor a function graph's placeholder `t` captures, or None."""
  graph = t.graph
  captures = getattr(graph, "captures", None)
  if t.op.type != "Placeholder" or not captures:
    return None
  for external, internal in captures:
    if internal is t:
      return external
  return None


def _function_graph(op, attr):
  try:
    return op.graph._get_function(op.get_attr(attr).name).graph  # pylint: disable=protected-access
  except (AttributeError, ValueError, TypeError) as e:
    logging.debug("per_example: cannot read the function of %s (%s)", op.name, e)
    return None


def _walk(graph, inputs):
  """[(label, via)] of `graph`'s outputs, its inputs labelled `inputs`."""
  if graph is None or len(graph.inputs) != len(inputs):
    return None
  labeller = Labeller({p.ref(): label for p, (label, _) in zip(graph.inputs, inputs)})
  via = {p.ref(): v for p, (_, v) in zip(graph.inputs, inputs)}
  out = []
  for t in graph.outputs:
    label, how = labeller.label(t)
    out.append((label, how or via.get(t.ref(), "")))
  return out


def _nested_labels(op, found):
  """Per-output labels of a function-call, branch or loop op, or None when unreadable."""
  if op.type in _CALLS:
    return _walk(_function_graph(op, "f"), found)
  if op.type in _BRANCHES:  # Inputs: the condition, then the branches' arguments.
    branches = [_walk(_function_graph(op, a), found[1:]) for a in ("then_branch", "else_branch")]
    if None in branches or len(branches[0]) != len(branches[1]):
      return None
    return [(join(a, b), va or vb) for (a, va), (b, vb) in zip(*branches)]
  body = _function_graph(op, "body")
  state = list(found)
  for _ in range(_LOOP_PASSES):
    out = _walk(body, state)
    if out is None or len(out) != len(state):
      return None
    grown = [(join(a, b), va or vb) for (a, va), (b, vb) in zip(state, out)]
    if [a for a, _ in grown] == [a for a, _ in state]:
      return grown
    state = grown
  return [((MOVED if a is not None else None), v) for a, v in state]
