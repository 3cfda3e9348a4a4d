"""Built-in tasks whose loss couples the whole batch (`base_task.BatchLossTask`).

Averaging micro-batch gradients is not the big batch's gradient for these; with
`accumulation.mode=gradcache` it is (`trainer.gradcache`, docs/accumulation.md):

  contrastive_pairs   InfoNCE with in-batch negatives (SimCLR/CLIP style): two views of each
                      Fashion-MNIST image; every other example of the update is a negative.
  batch_hard_triplet  batch-hard triplet mining (Hermans et al., 2017) for the seed-004 network:
                      for each anchor, the farthest positive and the nearest negative among ALL
                      examples of the update, even when each micro-batch holds one.
  histogram_chi_square  the seed-002 caveat: a chi-square between a soft (differentiable)
                      histogram of the model's outputs and the histogram of the targets, over the
                      whole update's examples; with few examples per micro-batch the bins are
                      nearly empty.

Each `batch_loss` takes `valid` (0 for padding rows of an evaluation batch) and ignores those
rows. Eager at construction; `ExampleSource.take`, `represent` and `batch_loss` are traced.
"""
import numpy as np
import tensorflow as tf

from trainer import base_task
from trainer import errors
from trainer.tasks import fashion_mnist
from trainer.tasks import models

_NOISE_BANK = 256  # Second views: the image plus one of these fixed noise patterns.


class _FashionBatchTask(base_task.BatchLossTask):
  """Fashion-MNIST images through an embedder; `_take` builds a batch from example ids."""

  def __init__(self, config):
    super().__init__(config)
    fashion_mnist._check_config(config, models.MODELS)  # pylint: disable=protected-access

  def build_model(self):
    size = self.config.data.image_size
    return models.embedder(self.config.model, (size, size, 1), self.config.triplet.embedding_dim,
                           self.config.mixed_precision)

  def _source(self, split):
    images, labels = fashion_mnist.load_arrays(self.config.data, split)
    with tf.device("/cpu:0"):
      tensors = (tf.constant(images), tf.constant(labels), tf.constant(
          np.random.RandomState(7).normal(0, 0.3, (_NOISE_BANK, 28, 28)).astype(np.float32)))
    size = self.config.data.image_size

    def take(ids, positions):
      images_t, labels_t, noise_t = tensors
      raw = tf.gather(images_t, ids)
      noisy = tf.cast(raw, tf.float32) / 255.0 + tf.gather(noise_t, positions % _NOISE_BANK)
      view = lambda x: x[..., None] if size == 28 else tf.image.resize(x[..., None], (size, size))
      return {"image": fashion_mnist._images(raw, size),  # pylint: disable=protected-access
              "view": view(tf.clip_by_value(noisy, 0.0, 1.0)), "label": tf.gather(labels_t, ids)}
    return base_task.ExampleSource(num_examples=len(labels), take=take)

  def train_data(self):
    return self._source("train")

  def eval_data(self):
    return self._source("test")


def _embed(model, images, training):
  return tf.cast(model(images, training=training), tf.float32)


class ContrastivePairs(_FashionBatchTask):
  """InfoNCE: each image's embedding must pick its own second view among all in the batch."""
  metric_names = ("pair_accuracy",)

  def represent(self, model, batch, training):
    return {"a": _embed(model, batch["image"], training),
            "b": _embed(model, batch["view"], training)}

  def batch_loss(self, representations, valid):
    a, b = representations["a"], representations["b"]
    logits = tf.matmul(a, b, transpose_b=True) / self.config.contrastive.temperature
    logits += (1.0 - valid)[None, :] * -1e9  # Padding rows are no negatives.
    targets = tf.range(tf.shape(a)[0])
    loss_ab = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
    loss_ba = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=tf.transpose(logits) + (1.0 - valid)[None, :] * -1e9)
    count = tf.maximum(tf.reduce_sum(valid), 1.0)
    loss = tf.reduce_sum(0.5 * (loss_ab + loss_ba) * valid) / count
    hit = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), targets), tf.float32)
    return base_task.BatchLossOutput(loss=loss,
                                     metrics={"pair_accuracy": tf.reduce_sum(hit * valid) / count})


class BatchHardTriplet(_FashionBatchTask):
  """Batch-hard triplet loss on squared distances: the hardest positive and negative per anchor.

  Anchors without a positive in the batch (their class appears once) do not count.
  """
  metric_names = ("triplet_accuracy",)

  def represent(self, model, batch, training):
    return {"embedding": _embed(model, batch["image"], training), "label": batch["label"]}

  def batch_loss(self, representations, valid):
    z, labels = representations["embedding"], representations["label"]
    sq = tf.reduce_sum(tf.square(z), axis=1)
    distances = tf.maximum(sq[:, None] + sq[None, :] - 2.0 * tf.matmul(z, z, transpose_b=True),
                           0.0)
    pair_valid = valid[:, None] * valid[None, :]
    same = tf.cast(tf.equal(labels[:, None], labels[None, :]), tf.float32) * pair_valid
    same *= 1.0 - tf.eye(tf.shape(z)[0])
    other = (1.0 - tf.cast(tf.equal(labels[:, None], labels[None, :]), tf.float32)) * pair_valid
    hardest_positive = tf.reduce_max(distances * same, axis=1)
    big = tf.reduce_max(distances) + 1.0
    hardest_negative = tf.reduce_min(distances * other + big * (1.0 - other), axis=1)
    counted = valid * tf.cast(tf.reduce_sum(same, axis=1) > 0, tf.float32) * tf.cast(
        tf.reduce_sum(other, axis=1) > 0, tf.float32)
    count = tf.maximum(tf.reduce_sum(counted), 1.0)
    hinge = tf.nn.relu(hardest_positive - hardest_negative + self.config.triplet.margin)
    correct = tf.cast(hardest_positive < hardest_negative, tf.float32)
    return base_task.BatchLossOutput(
        loss=tf.reduce_sum(hinge * counted) / count,
        metrics={"triplet_accuracy": tf.reduce_sum(correct * counted) / count})


class HistogramChiSquare(base_task.BatchLossTask):
  """Match the distribution of the model's outputs to the targets' with a chi-square.

  Each example is a feature vector x and a target t (generated: t = sin(x·w) + noise). The
  model maps x to one number y; the loss compares soft histograms (Gaussian kernels on
  `histogram.bins` bins over [-2, 2]) of all y and all t of the batch:
  chi² = Σ_bins (h_y - h_t)² / (h_y + h_t + 1) / N. No per-example loss gives this gradient.
  """
  metric_names = ()

  def __init__(self, config):
    super().__init__(config)
    if config.histogram.bins < 2 or not config.histogram.width > 0:
      raise errors.ConfigError(f"`histogram.bins`={config.histogram.bins} must be >= 2 and "
                               f"`histogram.width`={config.histogram.width} > 0")
    for field in ("features", "train_examples"):  # features=0 aborted the process in oneDNN.
      value = config.histogram[field]
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.ConfigError(f"`histogram.{field}`={value!r} must be an integer >= 1")

  def build_model(self):
    return models.classifier("mlp", (self.config.histogram.features,), 1,
                             self.config.mixed_precision)

  def _arrays(self, size, seed):
    features = self.config.histogram.features
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(size, features)).astype(np.float32)
    w = np.random.RandomState(0).normal(size=(features,)).astype(np.float32) / np.sqrt(features)
    t = np.sin(2.0 * x @ w) + 0.1 * rng.normal(size=size)
    return {"x": x, "t": t.astype(np.float32)}

  def train_data(self):
    return self._arrays(self.config.histogram.train_examples, 1)

  def eval_data(self):
    return self._arrays(512, 2)

  def represent(self, model, batch, training):
    return {"y": tf.cast(model(batch["x"], training=training), tf.float32)[:, 0],
            "t": batch["t"]}

  def _soft_counts(self, values, valid):
    centers = tf.linspace(-2.0, 2.0, self.config.histogram.bins)
    kernel = tf.exp(-0.5 * tf.square((values[:, None] - centers[None, :])
                                     / self.config.histogram.width))
    kernel /= tf.reduce_sum(kernel, axis=1, keepdims=True) + 1e-12
    return tf.reduce_sum(kernel * valid[:, None], axis=0)

  def batch_loss(self, representations, valid):
    h_y = self._soft_counts(representations["y"], valid)
    h_t = self._soft_counts(tf.stop_gradient(representations["t"]), valid)
    count = tf.maximum(tf.reduce_sum(valid), 1.0)
    return base_task.BatchLossOutput(
        loss=tf.reduce_sum(tf.square(h_y - h_t) / (h_y + h_t + 1.0)) / count)
