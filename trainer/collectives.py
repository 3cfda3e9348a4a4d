"""Counting cross-replica reductions: what tests and benchmarks use to prove "one per update".

Two views of the same fact:
  * `AllReduceCounter`: while a function is traced (or run eagerly), counts the outermost
    replica-context `all_reduce` calls on a context with more than one replica (and the tensors
    they carry), and the outermost cross-device reductions of any origin. The default context's
    all_reduce (an identity, e.g. Keras applying outside the strategy scope) and TF's internal
    re-entries do not count.
  * `collective_reduce_ops`: the CollectiveReduce* ops in a traced function and every function
    it calls (MirroredStrategy on CPUs and MultiWorkerMirroredStrategy emit them; one op per
    local device per reduction).
Eager, host-side utilities.
"""
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
