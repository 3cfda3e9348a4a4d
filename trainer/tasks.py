"""Tasks: what a model is, how a batch is made from stream positions, and the per-example loss.

A task never normalises its loss: it returns per-example losses, weights (0 for padding/masked
examples) and per-example metric values. The trainer sums `loss * weight` and divides by the sum
of weights of the whole update (all micro-steps, all replicas), so masks and uneven batches are
exact. `per_example_loss` is called traced, in replica context.
"""
import dataclasses

import numpy as np
import tensorflow as tf

from trainer import data
from trainer import models

TASKS = ("classification", "triplet")


@dataclasses.dataclass(frozen=True)
class LossOutput:
  """Attributes: loss [B] float32; weight [B] float32; metrics: name -> [B] float32 values."""
  loss: tf.Tensor
  weight: tf.Tensor
  metrics: dict


def _images(raw: tf.Tensor, image_size: int) -> tf.Tensor:
  images = tf.cast(raw, tf.float32)[..., None] / 255.0
  if image_size != 28:
    images = tf.image.resize(images, (image_size, image_size))
  return images


def _eval_ids(positions, num_examples):
  valid = positions < num_examples
  return tf.minimum(positions, num_examples - 1), tf.cast(valid, tf.float32)


class ClassificationTask:
  """Image classification with softmax cross-entropy; metric `accuracy`."""
  metric_names = ("accuracy",)

  def __init__(self, config):
    self.config = config

  def build_model(self):
    size = self.config.data.image_size
    return models.classifier(self.config.model, (size, size, 1), data.NUM_CLASSES,
                             self.config.mixed_precision)

  def batch_fn(self, split: str):
    """Returns make_batch(positions) -> dict, for `split` (train: shuffled stream; test: padded)."""
    images, labels = data.load_arrays(self.config.data, split)
    images, labels, n = tf.constant(images), tf.constant(labels), len(labels)
    seed, shuffle, size = self.config.seed, self.config.data.shuffle, self.config.data.image_size

    def make_batch(positions):
      if split == "train":
        ids, weight = data.shuffled_ids(positions, n, seed, shuffle), tf.ones_like(positions, tf.float32)
      else:
        ids, weight = _eval_ids(positions, n)
      return {"image": _images(tf.gather(images, ids), size), "label": tf.gather(labels, ids),
              "weight": weight}
    return make_batch

  def per_example_loss(self, model, batch, training: bool) -> LossOutput:
    logits = tf.cast(model(batch["image"], training=training), tf.float32)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["label"], logits=logits)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1), batch["label"]), tf.float32)
    return LossOutput(loss=loss, weight=batch["weight"], metrics={"accuracy": correct})


class TripletTask:
  """Anchor/positive/negative through one shared embedder; hinge triplet loss on squared distances.

  Position p of the stream gives the anchor (the shuffled example p) and, by two stateless hashes
  of p, a positive of the same class and a negative of another class: a triplet depends on p alone,
  so micro-batching never changes which triplets an update sees. Metric `triplet_accuracy`:
  d(a, p) < d(a, n).
  """
  metric_names = ("triplet_accuracy",)

  def __init__(self, config):
    self.config = config

  def build_model(self):
    size = self.config.data.image_size
    return models.embedder(self.config.model, (size, size, 1), self.config.triplet.embedding_dim,
                           self.config.mixed_precision)

  def batch_fn(self, split: str):
    images, labels = data.load_arrays(self.config.data, split)
    n = len(labels)
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=data.NUM_CLASSES)
    if counts.min() == 0:
      raise data.DataError(f"{split} split lacks a class; triplets need every class present")
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    tables = [tf.constant(a) for a in (images, labels, order, counts, offsets)]
    seed, shuffle, size = self.config.seed, self.config.data.shuffle, self.config.data.image_size

    def hash_(positions, salt):
      big = tf.constant(2**31 - 2, tf.int64)
      return tf.random.experimental.index_shuffle(
          positions % (big + 1), tf.constant([seed, salt], tf.int64), tf.fill(tf.shape(positions), big))

    def make_batch(positions):
      images_t, labels_t, order_t, counts_t, offsets_t = tables
      if split == "train":
        anchor, weight = data.shuffled_ids(positions, n, seed, shuffle), tf.ones_like(positions, tf.float32)
      else:
        anchor, weight = _eval_ids(positions, n)
      cls = tf.gather(labels_t, anchor)
      pos = tf.gather(order_t, tf.gather(offsets_t, cls) + hash_(positions, 1) % tf.gather(counts_t, cls))
      other = (cls + 1 + hash_(positions, 2) % (data.NUM_CLASSES - 1)) % data.NUM_CLASSES
      neg = tf.gather(order_t, tf.gather(offsets_t, other) + hash_(positions, 3) % tf.gather(counts_t, other))
      get = lambda ids: _images(tf.gather(images_t, ids), size)
      return {"anchor": get(anchor), "positive": get(pos), "negative": get(neg), "weight": weight}
    return make_batch

  def per_example_loss(self, model, batch, training: bool) -> LossOutput:
    stacked = tf.concat([batch["anchor"], batch["positive"], batch["negative"]], axis=0)
    anchor, positive, negative = tf.split(tf.cast(model(stacked, training=training), tf.float32), 3)
    d_ap = tf.reduce_sum(tf.square(anchor - positive), -1)
    d_an = tf.reduce_sum(tf.square(anchor - negative), -1)
    loss = tf.nn.relu(d_ap - d_an + self.config.triplet.margin)
    return LossOutput(loss=loss, weight=batch["weight"],
                      metrics={"triplet_accuracy": tf.cast(d_ap < d_an, tf.float32)})


def create_task(config):
  if config.task == "classification":
    return ClassificationTask(config)
  if config.task == "triplet":
    return TripletTask(config)
  raise ValueError(f"`task`={config.task!r} unknown; allowed: {', '.join(TASKS)}")
