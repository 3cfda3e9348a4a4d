"""Fashion-MNIST tasks: image classification and a triplet embedding (seed questions 2 and 3).

Ordinary tasks written against the public API (`trainer.base_task`) only. The images come from
the Debian package's IDX files (`data.source=idx`, the default), `tfds`, or a learnable
generated set (`synthetic`). Both tasks preprocess on the host, inside the input pipeline
(uint8 -> float in [0, 1], optional bilinear resize to `data.image_size`). Eager at
construction; `ExampleSource.take` and `per_example_loss` are traced.
"""
import functools
import gzip
import os

import numpy as np
import tensorflow as tf

from trainer import base_task
from trainer import errors
from trainer.tasks import models

NUM_CLASSES = 10
SOURCES = ("idx", "tfds", "synthetic")
_IDX_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
APT_HINT = ("install it with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu; with sudo "
            "unless root), or set `data.dir`, or `data.source`=tfds|synthetic")


# --------------------------------------------------------------------------- the arrays ------
def _read_idx(path: str) -> np.ndarray:
  try:
    with gzip.open(path, "rb") as f:
      raw = f.read()
  except (OSError, EOFError) as e:  # Truncated or not gzip at all (BadGzipFile is an OSError).
    raise errors.DataError(f"{path} is not a readable gzip file ({type(e).__name__}: {e}); "
                           + APT_HINT) from None
  if len(raw) < 8 or raw[0] != 0 or raw[1] != 0 or raw[2] != 8:
    raise errors.DataError(f"{path} is not an unsigned-byte IDX file")
  ndim = raw[3]
  dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
  data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
  if data.size != int(np.prod(dims)):
    raise errors.DataError(f"{path} is truncated: header says {dims}, found {data.size} bytes")
  return data.reshape(dims)


def _load_idx(data_dir: str, split: str):
  if not os.path.isdir(data_dir):
    raise errors.DataError(f"`data.dir`={data_dir!r} does not exist: Fashion-MNIST is missing; "
                           + APT_HINT)
  paths = [os.path.join(data_dir, f) for f in _IDX_FILES[split]]
  for path in paths:
    if not os.path.isfile(path):
      raise errors.DataError(f"`data.dir`={data_dir!r} lacks the file {os.path.basename(path)}; "
                             + APT_HINT)
  return _read_idx(paths[0]), _read_idx(paths[1])


def _load_tfds(name: str, split: str):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  images, labels = tfds.as_numpy(tfds.load(name, split=split, batch_size=-1, as_supervised=True))
  return images[..., 0], labels


def _synthetic(num_examples: int, split: str):
  """Learnable generated data: a fixed prototype per class plus noise (deterministic)."""
  prototypes = np.random.RandomState(1234).randint(0, 256, (NUM_CLASSES, 28, 28))
  rng = np.random.RandomState({"train": 1, "test": 2}[split])
  labels = rng.randint(0, NUM_CLASSES, num_examples)
  noise = rng.normal(0, 60, (num_examples, 28, 28))
  return np.clip(prototypes[labels] + noise, 0, 255).astype(np.uint8), labels


def check_arrays(images: np.ndarray, labels: np.ndarray, split: str) -> None:
  """Refuses arrays the models cannot train on, with one line naming what is wrong."""
  if images.ndim != 3 or images.shape[1:] != (28, 28):
    raise errors.DataError(f"{split} images have shape {images.shape}; expected [N, 28, 28]")
  if len(images) == 0:
    raise errors.DataError(f"{split} split is empty; expected at least one example")
  if labels.shape != (len(images),):
    raise errors.DataError(f"{split} labels have shape {labels.shape}; expected [{len(images)}]")
  if np.issubdtype(images.dtype, np.floating) and not np.all(np.isfinite(images)):
    raise errors.DataError(f"{split} images contain NaN or Inf values")
  if labels.min() < 0 or labels.max() >= NUM_CLASSES:
    raise errors.DataError(f"{split} labels span [{labels.min()}, {labels.max()}]; "
                           f"allowed: 0..{NUM_CLASSES - 1}")


@functools.lru_cache(maxsize=8)
def _cached_arrays(source, data_dir, name, split, synthetic_size):
  if source == "idx":
    images, labels = _load_idx(data_dir, split)
  elif source == "tfds":
    images, labels = _load_tfds(name, split)
  else:
    images, labels = _synthetic(synthetic_size, split)
  labels = np.asarray(labels).astype(np.int64)
  check_arrays(images, labels, split)
  return images, labels


def load_arrays(data_config, split: str):
  """(images uint8-like [N, 28, 28], labels int64 [N]) of `split` in {train, test}; eager."""
  size = (data_config.synthetic_train_examples if split == "train"
          else data_config.synthetic_test_examples)
  return _cached_arrays(data_config.source, data_config.dir, data_config.name, split, size)


def _images(raw: tf.Tensor, image_size: int) -> tf.Tensor:
  images = tf.cast(raw, tf.float32)[..., None] / 255.0
  if image_size != 28:
    images = tf.image.resize(images, (image_size, image_size))
  return images


def _check_config(config, allowed_models) -> None:
  if config.model not in allowed_models:
    raise errors.ConfigError(f"`model`={config.model!r} unknown for `task`={config.task!r}; "
                             f"allowed: {', '.join(allowed_models)}")
  if config.data.source not in SOURCES:
    raise errors.ConfigError(f"`data.source`={config.data.source!r} unknown; "
                             f"allowed: {', '.join(SOURCES)}")
  size = config.data.image_size
  if config.model.startswith("vgg") and size % 32:
    raise errors.ConfigError(f"`data.image_size`={size} must be a multiple of 32 for "
                             f"`model`={config.model} (five 2x2 poolings)")
  smallest = models.SMALLEST_INPUT.get(config.model, 1)
  if size < smallest:
    raise errors.ConfigError(f"`data.image_size`={size} is too small for `model`="
                             f"{config.model}; allowed: >= {smallest}")


# ---------------------------------------------------------------------------- the tasks ------
class _FashionMnistTask(base_task.Task):
  """What both tasks share: config checks and a source per split (`_source(split)`)."""

  def __init__(self, config):
    super().__init__(config)
    _check_config(config, models.MODELS)

  def _source(self, split: str) -> base_task.ExampleSource:
    raise NotImplementedError

  def train_data(self):
    return self._source("train")

  def eval_data(self):
    return self._source("test")


class Classification(_FashionMnistTask):
  """Image classification with softmax cross-entropy; metric `accuracy`."""
  metric_names = ("accuracy",)

  def build_model(self):
    size = self.config.data.image_size
    return models.classifier(self.config.model, (size, size, 1), NUM_CLASSES,
                             self.config.mixed_precision)

  def _source(self, split: str) -> base_task.ExampleSource:
    images, labels = load_arrays(self.config.data, split)
    with tf.device("/cpu:0"):
      images_t, labels_t = tf.constant(images), tf.constant(labels)
    size = self.config.data.image_size

    def take(ids, positions):
      del positions
      return {"image": _images(tf.gather(images_t, ids), size),
              "label": tf.gather(labels_t, ids)}
    return base_task.ExampleSource(num_examples=len(labels), take=take)

  def per_example_loss(self, model, batch, training):
    return models.softmax_classification(model(batch["image"], training=training), batch["label"])


class Triplet(_FashionMnistTask):
  """Anchor/positive/negative through one shared embedder; hinge loss on squared distances.

  Position p of the stream gives the anchor (the example the stream chose) and, by two stateless
  hashes of p, a positive of the same class and a negative of another class: a triplet depends on
  p alone, so micro-batching never changes which triplets an update sees. Metric
  `triplet_accuracy`: d(a, p) < d(a, n).
  """
  metric_names = ("triplet_accuracy",)

  def build_model(self):
    size = self.config.data.image_size
    return models.embedder(self.config.model, (size, size, 1),
                           self.config.triplet.embedding_dim, self.config.mixed_precision)

  def _source(self, split: str) -> base_task.ExampleSource:
    images, labels = load_arrays(self.config.data, split)
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    if counts.min() == 0:
      raise errors.DataError(f"{split} split lacks a class; triplets need every class present")
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    with tf.device("/cpu:0"):
      images_t, labels_t, order_t, counts_t, offsets_t = (
          tf.constant(a) for a in (images, labels, order, counts, offsets))
    seed, size = self.config.seed, self.config.data.image_size

    def hash_(positions, salt):
      big = tf.constant(2**31 - 2, tf.int64)
      return tf.random.experimental.index_shuffle(
          positions % (big + 1), tf.constant([seed, salt], tf.int64),
          tf.fill(tf.shape(positions), big))

    def pick(classes, positions, salt):
      offset = tf.gather(offsets_t, classes) + hash_(positions, salt) % tf.gather(counts_t, classes)
      return tf.gather(order_t, offset)

    def take(ids, positions):
      cls = tf.gather(labels_t, ids)
      other = (cls + 1 + hash_(positions, 2) % (NUM_CLASSES - 1)) % NUM_CLASSES
      get = lambda i: _images(tf.gather(images_t, i), size)
      return {"anchor": get(ids), "positive": get(pick(cls, positions, 1)),
              "negative": get(pick(other, positions, 3))}
    return base_task.ExampleSource(num_examples=len(labels), take=take)

  def per_example_loss(self, model, batch, training):
    stacked = tf.concat([batch["anchor"], batch["positive"], batch["negative"]], axis=0)
    anchor, positive, negative = tf.split(tf.cast(model(stacked, training=training), tf.float32), 3)
    d_ap = tf.reduce_sum(tf.square(anchor - positive), -1)
    d_an = tf.reduce_sum(tf.square(anchor - negative), -1)
    loss = tf.nn.relu(d_ap - d_an + self.config.triplet.margin)
    return base_task.LossOutput(loss=loss,
                                metrics={"triplet_accuracy": tf.cast(d_ap < d_an, tf.float32)})
