"""Input: Fashion-MNIST arrays and the deterministic, resumable example stream.

The training data is an infinite stream of example positions 0, 1, 2, ...; position p belongs to
epoch p // N and maps to example `index_shuffle(p % N, seed=[seed, epoch])`, a stateless
permutation. Global micro-batch g is positions [g*B, (g+1)*B). Replica r of R takes the slice
[r*B/R, (r+1)*B/R) of it. Hence:
  * the examples of every global batch are the same for any number of replicas or workers;
  * k micro-batches of B are exactly one batch of k*B (same order);
  * resuming needs only the number of micro-batches consumed, which the checkpoint stores
    (`micro_batches_seen`), instead of a serialized shuffle buffer.

Dataset functions run inside `tf.data` (traced, host CPU), once per input pipeline (worker), and
are handed to `strategy.distribute_datasets_from_function`, which deals the per-replica batches of
one pipeline round-robin to its local replicas.
"""
import functools
import gzip
import os
import sys

import numpy as np
import tensorflow as tf

NUM_CLASSES = 10
_IDX_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
APT_HINT = ("install it with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or set "
            "`data.dir`, or `data.source`=tfds|synthetic")


class DataError(ValueError):
  """Bad or missing input data; the message is one line naming the field."""


def _read_idx(path: str) -> np.ndarray:
  with gzip.open(path, "rb") as f:
    raw = f.read()
  if len(raw) < 8 or raw[0] != 0 or raw[1] != 0 or raw[2] != 8:
    raise DataError(f"{path} is not an unsigned-byte IDX file")
  ndim = raw[3]
  dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
  data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
  if data.size != int(np.prod(dims)):
    raise DataError(f"{path} is truncated: header says {dims}, found {data.size} bytes")
  return data.reshape(dims)


def _load_idx(data_dir: str, split: str):
  if not os.path.isdir(data_dir):
    raise DataError(f"`data.dir`={data_dir!r} does not exist: Fashion-MNIST is missing; "
                    + APT_HINT)
  paths = [os.path.join(data_dir, f) for f in _IDX_FILES[split]]
  missing = [p for p in paths if not os.path.exists(p)]
  if missing:
    raise DataError(f"`data.dir`={data_dir!r} lacks {os.path.basename(missing[0])}; " + APT_HINT)
  return _read_idx(paths[0]), _read_idx(paths[1])


def _load_tfds(name: str, split: str):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  images, labels = tfds.as_numpy(
      tfds.load(name, split=split, batch_size=-1, as_supervised=True))
  return images[..., 0], labels


def _synthetic(num_examples: int, split: str):
  """Learnable generated data: a fixed prototype per class plus noise (deterministic)."""
  prototypes = np.random.RandomState(1234).randint(0, 256, (NUM_CLASSES, 28, 28))
  rng = np.random.RandomState({"train": 1, "test": 2}[split])
  labels = rng.randint(0, NUM_CLASSES, num_examples)
  noise = rng.normal(0, 60, (num_examples, 28, 28))
  images = np.clip(prototypes[labels] + noise, 0, 255).astype(np.uint8)
  return images, labels


def check_arrays(images: np.ndarray, labels: np.ndarray, split: str) -> None:
  """Refuses arrays the models cannot train on, with one line naming what is wrong."""
  if images.ndim != 3 or images.shape[1:] != (28, 28):
    raise DataError(f"{split} images have shape {images.shape}; expected [N, 28, 28]")
  if len(images) == 0:
    raise DataError(f"{split} split is empty; expected at least one example")
  if labels.shape != (len(images),):
    raise DataError(f"{split} labels have shape {labels.shape}; expected [{len(images)}]")
  if np.issubdtype(images.dtype, np.floating) and not np.all(np.isfinite(images)):
    raise DataError(f"{split} images contain NaN or Inf values")
  if labels.min() < 0 or labels.max() >= NUM_CLASSES:
    raise DataError(f"{split} labels span [{labels.min()}, {labels.max()}]; "
                    f"allowed: 0..{NUM_CLASSES - 1}")


@functools.lru_cache(maxsize=8)
def _cached_arrays(source, data_dir, name, split, synthetic_size):
  if source == "idx":
    images, labels = _load_idx(data_dir, split)
  elif source == "tfds":
    images, labels = _load_tfds(name, split)
  elif source == "synthetic":
    images, labels = _synthetic(synthetic_size, split)
  else:
    raise DataError(f"`data.source`={source!r} unknown; allowed: idx, tfds, synthetic")
  labels = np.asarray(labels).astype(np.int64)
  check_arrays(images, labels, split)
  return images, labels


def load_arrays(data_config, split: str):
  """Returns (images uint8-like [N, 28, 28], labels int64 [N]) for `split` in {train, test}."""
  size = (data_config.synthetic_train_examples if split == "train"
          else data_config.synthetic_test_examples)
  return _cached_arrays(data_config.source, data_config.dir, data_config.name, split, size)


def shuffled_ids(positions: tf.Tensor, num_examples: int, seed: int, shuffle: bool) -> tf.Tensor:
  """Maps stream positions (int64 vector) to example ids; traced inside tf.data."""
  n = tf.constant(num_examples, tf.int64)
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


def replica_positions(chunk, input_context, global_batch: int):
  """Stream positions of the per-replica batch `chunk` of this input pipeline (traced)."""
  local = input_context.num_replicas_in_sync // input_context.num_input_pipelines
  per_replica = input_context.get_per_replica_batch_size(global_batch)
  global_index = chunk // local
  replica = input_context.input_pipeline_id * local + chunk % local
  start = global_index * global_batch + replica * per_replica
  return start + tf.range(per_replica, dtype=tf.int64)


def stream(input_context, global_batch: int, make_batch, start_batch: int = 0,
           num_batches: int | None = None) -> tf.data.Dataset:
  """Per-replica batches `make_batch(positions)` for global batches start_batch, ... (host)."""
  local = input_context.num_replicas_in_sync // input_context.num_input_pipelines
  stop = sys.maxsize if num_batches is None else (start_batch + num_batches) * local
  chunks = tf.data.Dataset.range(start_batch * local, stop)
  dataset = chunks.map(
      lambda c: make_batch(replica_positions(c, input_context, global_batch)),
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
  return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)
