"""Input: a task's data source turned into per-replica batches, deterministic and resumable.

Two kinds of source (see `trainer.base_task`; `trainer.sources` recognises and checks them):

**Random access** (dict of arrays, `.npz` path, DataFrame, indexable, `ExampleSource`). The
training data is an infinite stream of example positions 0, 1, 2, ...; position p belongs to
epoch p // N and maps to example `index_shuffle(p % N, seed=[seed, epoch])`, a stateless
permutation. Global micro-batch g is positions [g*B, (g+1)*B); replica r of R takes the slice
[r*B/R, (r+1)*B/R). Hence the examples of every global batch are the same for any number of
replicas or workers, k micro-batches of B are exactly one batch of k*B, and resuming needs only
the number of micro-batches consumed (`micro_batches_seen`, in the checkpoint). Evaluation
visits positions 0..N-1 once, padded to whole batches with `VALID_KEY` = 0.

**A tf.data factory.** Sharded by input pipeline (when the factory takes no input context),
repeated and batched per replica for training; batched, padded and sharded for evaluation. Resume
restores the iterator (`trainer.host_iterator`) or skips what was consumed
(`trainer.checkpointing`).

Every batch carries `sources.VALID_KEY` ([b] float32: 1 for real examples, 0 for padding),
which the trainer multiplies into the task's weights and removes before the task sees the batch.
Dataset functions run inside tf.data (traced, host CPU), once per input pipeline, and are handed
to `strategy.distribute_datasets_from_function`.
"""
import sys
from typing import Optional

import tensorflow as tf

from trainer import autograph
from trainer import base_task
from trainer import errors
from trainer import sources


# --------------------------------------------------------------- the position stream ----------
def shuffled_ids(positions: tf.Tensor, num: int, seed: int, shuffle: bool) -> tf.Tensor:
  """Maps stream positions (int64 vector) to example ids; traced inside tf.data."""
  n = tf.constant(num, tf.int64)
  offsets = positions % n
  if not shuffle:
    return offsets
  epochs = positions // n
  first = tf.reduce_min(epochs)
  seed = tf.constant(seed, tf.int64)
  max_index = tf.fill(tf.shape(offsets), n - 1)
  # A batch (<= N examples) spans at most two epochs: shuffle with both, pick per element.
  this_epoch = tf.random.experimental.index_shuffle(offsets, tf.stack([seed, first]), max_index)
  next_epoch = tf.random.experimental.index_shuffle(offsets, tf.stack([seed, first + 1]), max_index)
  return tf.where(epochs == first, this_epoch, next_epoch)


def local_replicas(input_context) -> int:
  """Replicas fed by this input pipeline (one pipeline per worker)."""
  return input_context.num_replicas_in_sync // input_context.num_input_pipelines


def replica_positions(chunk, input_context, global_batch: int):
  """Stream positions of the per-replica batch `chunk` of this input pipeline (traced)."""
  local = local_replicas(input_context)
  per_replica = input_context.get_per_replica_batch_size(global_batch)
  global_index = chunk // local
  replica = input_context.input_pipeline_id * local + chunk % local
  start = global_index * global_batch + replica * per_replica
  return start + tf.range(per_replica, dtype=tf.int64)


def _with_options(dataset: tf.data.Dataset) -> tf.data.Dataset:
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
  return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)


def _checked(batch, what: str):
  if not isinstance(batch, dict):
    raise errors.DataError(f"{what} elements are {type(batch).__name__}; expected dicts of "
                           "tensors, e.g. dataset.map(lambda x, y: {'x': x, 'y': y})")
  if sources.VALID_KEY in batch:
    raise errors.DataError(
        f"{what} has a field named {sources.VALID_KEY!r}, which microstep reserves")
  return batch


def batch_at(source: base_task.ExampleSource, positions, *, seed: int, shuffle: bool) -> dict:
  """The training batch at these stream positions, as `train_stream` yields it.

  Eager or traced. Tests and reference computations use it to rebuild an update's batch.
  """
  positions = tf.convert_to_tensor(positions, tf.int64)
  ids = shuffled_ids(positions, source.num_examples, seed, shuffle)
  batch = dict(_checked(autograph.task_code(source.take)(ids, positions), "train data"))
  batch[sources.VALID_KEY] = tf.ones(tf.shape(positions), tf.float32)
  return batch


def train_stream(input_context, source: base_task.ExampleSource, global_batch: int, *,
                 seed: int, shuffle: bool, start_batch: int = 0) -> tf.data.Dataset:
  """Per-replica training batches of global micro-batches start_batch, ... (host)."""
  local = local_replicas(input_context)

  @autograph.library
  def make_batch(chunk):
    positions = replica_positions(chunk, input_context, global_batch)
    return batch_at(source, positions, seed=seed, shuffle=shuffle)
  chunks = tf.data.Dataset.range(start_batch * local, sys.maxsize)
  return _with_options(chunks.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE,
                                  deterministic=True))


def eval_stream(input_context, source: base_task.ExampleSource, global_batch: int,
                num_batches: Optional[int] = None) -> tf.data.Dataset:
  """Per-replica batches visiting examples 0..N-1 once, padded with VALID_KEY = 0 (host).

  `num_batches` global batches (default: enough to cover the source once).
  """
  local = local_replicas(input_context)
  steps = eval_steps(source, global_batch) if num_batches is None else num_batches

  @autograph.library
  def make_batch(chunk):
    positions = replica_positions(chunk, input_context, global_batch)
    valid = positions < source.num_examples
    ids = tf.minimum(positions, source.num_examples - 1)
    batch = dict(_checked(autograph.task_code(source.take)(ids, positions), "eval data"))
    batch[sources.VALID_KEY] = tf.cast(valid, tf.float32)
    return batch
  chunks = tf.data.Dataset.range(0, steps * local)
  return _with_options(chunks.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE,
                                  deterministic=True))


def eval_steps(source, global_batch: int) -> int:
  """Batches that cover a random-access source once; -1 (until exhausted) for tf.data."""
  size = sources.num_examples(source)
  return -1 if size is None else -(-size // global_batch)


# ---------------------------------------------------------------- tf.data factories -----------
@autograph.library
def _mark_valid(*parts):
  # Dataset.map passes a tuple element's parts as separate arguments: check the tuple whole.
  batch = dict(_checked(parts[0] if len(parts) == 1 else parts, "tf.data source"))
  size = tf.shape(tf.nest.flatten(batch)[0])[0]
  batch[sources.VALID_KEY] = tf.ones([size], tf.float32)
  return batch


def factory_train_stream(input_context, factory: sources.DatasetFactory, global_batch: int, *,
                         skip_batches: int = 0, for_specs: bool = False) -> tf.data.Dataset:
  """Per-replica training batches from a tf.data factory: repeated, full batches (host).

  `skip_batches` global micro-batches are dropped first (resume without a stored iterator).
  A source with fewer examples than one replica's batch raises ConfigError, unless the stream
  is built `for_specs` only (`trainer.export.batch_spec`, which also reads evaluation data).
  """
  local = local_replicas(input_context)
  per_replica = input_context.get_per_replica_batch_size(global_batch)
  examples = factory.dataset(input_context)
  size = int(examples.cardinality())  # -1 repeated already, -2 unknown (e.g. after a filter).
  if 0 < size < per_replica and not for_specs:  # Batches would repeat examples (as arrays).
    where = " on this input pipeline" if input_context.num_input_pipelines > 1 else ""
    raise errors.ConfigError(
        f"`batch_size`={global_batch} gives each replica {per_replica} examples, more than the "
        f"{size} of the tf.data training source{where}; allowed: at most {size} per replica")
  dataset = examples.repeat().batch(per_replica, drop_remainder=True)
  dataset = dataset.map(_mark_valid, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  if skip_batches:
    dataset = dataset.skip(skip_batches * local)
  return _with_options(dataset)


def _pad_to(batch, size: int):
  """Pads every field of a (possibly short) batch to `size` rows; padded rows are invalid."""
  def pad(t):
    if isinstance(t, tf.SparseTensor):  # Rows past the last index are empty: grow the shape.
      padded = tf.SparseTensor(t.indices, t.values, tf.concat([[size], t.dense_shape[1:]], 0))
      padded.set_shape([size] + t.shape[1:])
      return padded
    if isinstance(t, tf.RaggedTensor):  # Empty rows: repeat the last row split.
      splits = t.row_splits
      missing = size - t.nrows(out_type=splits.dtype)
      return tf.RaggedTensor.from_row_splits(
          t.values, tf.concat([splits, tf.fill([missing], splits[-1])], 0), validate=False)
    missing = size - tf.shape(t)[0]
    if t.shape.rank is None:  # Of unknown rank (a tf.numpy_function's): a padding of any rank.
      padding = tf.concat([[[0, missing]], tf.zeros([tf.rank(t) - 1, 2], tf.int32)], axis=0)
      return tf.pad(t, padding)
    padding = [[0, missing]] + [[0, 0]] * (t.shape.rank - 1)
    return tf.ensure_shape(tf.pad(t, padding), [size] + t.shape[1:])
  return tf.nest.map_structure(pad, batch)  # (Nested dicts too: `tfds` features often are.)


def factory_eval_stream(input_context, factory: sources.DatasetFactory,
                        global_batch: int) -> tf.data.Dataset:
  """Per-replica evaluation batches from a tf.data factory, one pass, padded (host).

  The last batch is padded to full size (VALID_KEY 0), and all-padding batches are appended so
  that every local replica gets a batch at every step.
  """
  local = local_replicas(input_context)
  per_replica = input_context.get_per_replica_batch_size(global_batch)
  batches = factory.dataset(input_context).batch(per_replica).map(
      autograph.library(lambda *parts: _pad_to(_mark_valid(*parts), per_replica)))
  if local > 1:
    empty = batches.take(1).map(autograph.library(
        lambda b: {k: (tf.zeros_like(v) if k == sources.VALID_KEY else v) for k, v in b.items()}))
    batches = (batches.concatenate(empty.repeat(local - 1))
               .batch(local, drop_remainder=True).unbatch())
  return _with_options(batches)
