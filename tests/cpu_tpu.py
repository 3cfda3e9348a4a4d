"""A TPUStrategy whose "TPU cores" are CPU devices: enough to TRACE replica functions on a CPU.

TensorFlow's TPUStrategy wraps every function given to `strategy.run` in `tpu.replicate` and
creates TPU variables (packed handles, TPU-specific update rules). Building the graph needs no
TPU; running it does. `cpu_tpu_strategy()` answers TPUStrategy's one question to the hardware,
the system metadata, with `replicas` cores named TPU:0..; soft device placement puts their
variables on the CPU. Tests then trace (never run) the same code a TPU would compile, so what
cannot live inside `tpu.replicate` (non-tensor return values, cross-replica applies on packed
variables) fails here too.
"""
import collections

import tensorflow as tf
from tensorflow.python.tpu import tpu_system_metadata

_Device = collections.namedtuple("_Device", "name device_type")


class _CpuTpuResolver(tf.distribute.cluster_resolver.ClusterResolver):
  """Describes a one-host "TPU" system with `replicas` cores; talks to nothing."""

  def __init__(self, replicas):
    self._replicas = replicas

  def cluster_spec(self):
    return tf.train.ClusterSpec({})

  def master(self, task_type=None, task_id=None, rpc_layer=None):
    return ""

  def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
    return {"TPU": self._replicas}

  def get_tpu_system_metadata(self):
    devices = [_Device(f"/job:localhost/replica:0/task:0/device:TPU:{i}", "TPU")
               for i in range(self._replicas)]
    return tpu_system_metadata.TPUSystemMetadata(
        num_cores=self._replicas, num_hosts=1, num_of_cores_per_host=self._replicas,
        topology=None, devices=devices)


def cpu_tpu_strategy(replicas: int = 2) -> tf.distribute.TPUStrategy:
  """A TPUStrategy over `replicas` fake cores (eager); for tracing only."""
  if not tf.config.get_soft_device_placement():
    raise RuntimeError("cpu_tpu_strategy needs soft device placement (TensorFlow's default)")
  return tf.distribute.TPUStrategy(_CpuTpuResolver(replicas))


def replicated_write_ops(graph) -> tuple[list, list]:
  """(inside, outside): variable-writing ops inside / outside the `tpu.replicate` cluster.

  Walks the graph and every function it calls; an op inside a function called from inside the
  cluster counts as inside.
  """
  writes = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
            "ResourceScatterAdd", "ResourceScatterUpdate")
  inside, outside = [], []
  functions = {}

  def library(g):
    for name, function in getattr(g, "_functions", {}).items():
      inner = getattr(function, "graph", None)
      if inner is not None and name not in functions:
        functions[name] = inner
        library(inner)
  library(graph)

  def walk(g, in_cluster, seen):
    for op in g.get_operations():
      here = in_cluster or "_tpu_replicate" in op.node_def.attr
      if op.type in writes:
        (inside if here else outside).append(op.name)
      for attr in op.node_def.attr.values():
        names = [attr.func.name] if attr.HasField("func") else [f.name for f in attr.list.func]
        for name in names:
          if name in functions and (name, here) not in seen:
            seen.add((name, here))
            walk(functions[name], here, seen)
  walk(graph, False, set())
  return inside, outside
