"""Counting what crosses replicas: what tests and benchmarks use to prove "one all-reduce per update".

Two views of the same fact:
  * `AllReduceCounter`: while a function is traced (or run eagerly), counts the outermost
    replica-context `all_reduce` calls on a context with more than one replica (and the tensors
    they carry), and the outermost cross-device reductions of any origin. The default context's
    all_reduce (an identity, e.g. Keras applying outside the strategy scope) and TF's internal
    re-entries do not count.
  * `collective_reduce_ops`: the CollectiveReduce* ops in a traced function and every function
    it calls (MirroredStrategy on CPUs and MultiWorkerMirroredStrategy emit them; one op per
    local device per reduction).
And what else crosses devices: `device_transfers` lists the tensors a function sends from one
device to another after TensorFlow partitions its graph (`_Send` ops), with their sizes.
Eager, host-side utilities.
"""
import dataclasses
from unittest import mock

import tensorflow as tf


class AllReduceCounter:
  """Context manager counting reductions inside the block.

  `calls`/`tensors`: outermost replica-context `all_reduce` calls on a multi-replica context and
  the tensors they carry. `cross_device`: outermost `CrossDeviceOps.reduce`/`batch_reduce` calls,
  the layer every strategy reduction goes through, including those hidden in variable updates
  (e.g. assigning per-replica values to a mirrored variable reduces them).
  """

  def __init__(self):
    self.calls, self.tensors, self.cross_device = 0, 0, 0
    self._depth = {"all_reduce": 0, "cross_device": 0}
    all_reduce = tf.distribute.ReplicaContext.all_reduce
    reduce, batch_reduce = tf.distribute.CrossDeviceOps.reduce, tf.distribute.CrossDeviceOps.batch_reduce

    def counted(kind, original, on_outermost):
      def wrapper(*args, **kwargs):
        if self._depth[kind] == 0:
          on_outermost(*args)
        self._depth[kind] += 1
        try:
          return original(*args, **kwargs)
        finally:
          self._depth[kind] -= 1
      return wrapper

    def on_all_reduce(ctx, reduce_op, value, *unused):
      if ctx.num_replicas_in_sync > 1:
        self.calls += 1
        self.tensors += len(tf.nest.flatten(value))

    def on_cross_device(*unused):
      self.cross_device += 1

    self._patches = [
        mock.patch.object(tf.distribute.ReplicaContext, "all_reduce",
                          counted("all_reduce", all_reduce, on_all_reduce)),
        mock.patch.object(tf.distribute.CrossDeviceOps, "reduce",
                          counted("cross_device", reduce, on_cross_device)),
        mock.patch.object(tf.distribute.CrossDeviceOps, "batch_reduce",
                          counted("cross_device", batch_reduce, on_cross_device))]

  def __enter__(self):
    for patch in self._patches:
      patch.__enter__()
    return self

  def __exit__(self, *exc):
    for patch in reversed(self._patches):
      patch.__exit__(*exc)


def collective_reduce_ops(concrete_function) -> int:
  """CollectiveReduce* ops in `concrete_function`'s graph and its function library."""
  graph_def = concrete_function.graph.as_graph_def()
  nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
  return sum(1 for n in nodes if n.op.startswith("CollectiveReduce"))


# ------------------------------------------------------------- what crosses devices ----------
@dataclasses.dataclass(frozen=True)
class Transfer:
  """One tensor sent between devices (a `_Send` op after graph partitioning).

  Attributes: source, target (device names); tensor (its name in the traced graph); dtype;
  num_bytes (None when the static shape is unknown).
  """
  source: str
  target: str
  tensor: str
  dtype: str
  num_bytes: int | None


def _output_sizes(graph, sizes, seen) -> dict:
  """`op:index` -> set of (dtype, bytes or None) over `graph` and every function it calls."""
  for op in graph.get_operations():
    for i, t in enumerate(op.outputs):
      if t.dtype in (tf.resource, tf.variant):
        nbytes = 0
      elif t.shape.is_fully_defined():
        nbytes = t.shape.num_elements() * t.dtype.size
      else:
        nbytes = None
      sizes.setdefault(f"{op.name}:{i}", set()).add((t.dtype.name, nbytes))
  for name, function in getattr(graph, "_functions", {}).items():  # Bodies, branches, calls.
    inner = getattr(function, "graph", None)
    if name not in seen and inner is not None:
      seen.add(name)
      _output_sizes(inner, sizes, seen)
  return sizes


def _lookup(sizes, tensor_name):
  """Finds a partitioned tensor in the traced graphs.

  Inlined function bodies keep the inner op name behind a prefix
  (`cond/then/_67/cond/Add` is `cond/Add` of the branch): the longest known suffix wins.
  """
  name, _, index = tensor_name.partition(":")
  parts = name.split("/")
  for start in range(len(parts)):
    key = "/".join(parts[start:]) + ":" + (index or "0")
    if key in sizes:
      dtype = sorted({d for d, _ in sizes[key]})[0]
      known = [b for _, b in sizes[key]]
      return dtype, None if None in known else max(known)
  return None


def device_transfers(python_function, *args) -> list:
  """Runs `python_function(*args)` once as a NEW tf.function; returns its data `Transfer`s.

  Eager, host. TensorFlow records the partitioned graphs when a function is instantiated with
  run metadata on; every `_Send` whose input is a data tensor (not a control edge) is one
  transfer. Sizes come from the static shapes of the traced graph (all shapes in microstep's
  update are static); the loop predicate of a while loop is a bool scalar.
  """
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  function = tf.function(python_function)
  context.context().enable_run_metadata()
  try:
    function(*args)
    metadata = context.context().export_run_metadata()
  finally:
    context.context().disable_run_metadata()
  sizes = _output_sizes(function.get_concrete_function(*args).graph, {}, set())
  transfers = []
  for graph in metadata.function_graphs:
    for partition in graph.partition_graphs:
      nodes = {n.name: n for n in partition.node}
      for node in partition.node:
        if node.op != "_Send" or "/ctrl/" in node.input[0]:
          continue
        source_name = node.input[0].partition(":")[0]
        source = nodes.get(source_name)
        if source is not None and source.op == "LoopCond":
          found = ("bool", 1)
        elif source is not None and source.op == "_Arg" and "_output_shapes" in source.attr:
          shape = tf.TensorShape(source.attr["_output_shapes"].list.shape[0])
          dtype = tf.as_dtype(source.attr["T"].type)
          found = (dtype.name, shape.num_elements() * dtype.size
                   if shape.is_fully_defined() else None)
        else:
          found = _lookup(sizes, node.input[0]) or ("unknown", None)
        transfers.append(Transfer(source=node.attr["send_device"].s.decode(),
                                  target=node.attr["recv_device"].s.decode(),
                                  tensor=node.input[0], dtype=found[0], num_bytes=found[1]))
  return transfers
