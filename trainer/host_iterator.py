"""One worker's training input as one checkpointable tf.data iterator on the host.

`HostIterator` is built eagerly on the host, once per worker, from the dataset function of
`trainer.data`; its `next()` runs traced, in cross-replica context (inside the Orbit train step),
and hands each local replica its slice of the host batch. `unsaveable_state` tells, eagerly and
before the run depends on it, whether TensorFlow can checkpoint such an iterator at all.
"""
import os
import re
from typing import Optional

import tensorflow as tf

from trainer import errors


def unsaveable_state(iterator) -> Optional[str]:
  """Why TensorFlow cannot checkpoint `iterator` (a `tf.data` iterator), or None if it can.

  A pipeline whose state lives outside TensorFlow cannot be saved: `tf.py_function`,
  `tf.numpy_function`, `Dataset.from_generator` (Python state), stateful random ops
  (`tf.random.uniform`, `tf.image.random_flip_left_right`, a `tf.random.Generator`), and
  datasets without serialisation. Saving then fails; this tries it once, eagerly, on the host,
  into TensorFlow's in-memory file system, before the run depends on it.
  """
  probe = f"ram://microstep_iterator_probe_{os.getpid()}_{id(iterator)}"
  try:
    tf.train.Checkpoint(iterator=iterator).write(probe + "/ckpt")
  except (tf.errors.FailedPreconditionError, tf.errors.UnimplementedError) as e:
    return re.sub(r"\.?\s*name:.*$", "", errors.describe_error(e).split(": ", 1)[-1])
  finally:
    if tf.io.gfile.exists(probe):
      tf.io.gfile.rmtree(probe)
  return None


class HostIterator:
  """One worker's training input as ONE plain tf.data iterator, which a checkpoint can hold.

  TensorFlow's distributed iterators cannot be checkpointed (they are not trackable,
  tensorflow#56372; MultiDeviceIterator keeps no saveable state). This iterator reads the
  worker's per-replica batches from an ordinary `tf.data` iterator on the host, `local` replicas'
  batches at a time, and hands each local replica its slice through
  `strategy.experimental_distribute_values_from_function`. `next()` runs traced, in cross-replica
  context (the Orbit train step); `checkpointable` is what `tf.train.Checkpoint` saves. The cost:
  no prefetching onto accelerators, so the batch is copied to each device inside the step.
  """

  def __init__(self, strategy, dataset_fn, *, num_workers: int, worker_id: int):
    replicas = strategy.num_replicas_in_sync
    self._local = replicas // num_workers
    self._strategy = strategy
    context = tf.distribute.InputContext(num_input_pipelines=num_workers,
                                         input_pipeline_id=worker_id,
                                         num_replicas_in_sync=replicas)
    with tf.device("/cpu:0"):
      self.checkpointable = iter(dataset_fn(context).batch(self._local, drop_remainder=True))

  def __iter__(self):
    return self

  def __next__(self):
    stacked = next(self.checkpointable)
    local = self._local
    return self._strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.nest.map_structure(
            lambda t: _row(t, ctx.replica_id_in_sync_group % local), stacked))


def _row(stacked, index):
  """Row `index` of a batch of replica batches: a dense or ragged tensor's, or a SparseTensor's
  (a `VarLenFeature` field), which has no `[]`. Traced, cross-replica context."""
  if not isinstance(stacked, tf.SparseTensor):
    return stacked[index]
  rest = stacked.dense_shape[1:]
  row = tf.sparse.slice(stacked, tf.concat([[index], tf.zeros_like(rest)], 0),
                        tf.concat([[1], rest], 0))
  row = tf.sparse.reshape(row, rest)
  row.set_shape(stacked.shape[1:])  # (The reshape to a tensor's value loses the static shape.)
  return row
