"""Classification of your own arrays from one `.npz` file named in the config.

The file holds `x_train`, `y_train` and, for evaluation, `x_test`, `y_test` (the layout of
`keras.datasets` files such as mnist.npz); the key prefixes are `data.features_key` and
`data.labels_key`. Labels are integers 0..C-1; C is read from the training labels (or set
`data.num_classes`). The model is an MLP over the flattened features (`model=mlp`) or the small
CNN for [N, H, W] / [N, H, W, C] images (`model=small_cnn`). Eager at construction (the file is
read and checked once); `per_example_loss` is traced.
"""
import os

import numpy as np

from trainer import base_task
from trainer import errors
from trainer.tasks import models

MODELS = ("mlp", "small_cnn")


class NpzClassification(base_task.Task):
  """Softmax classification of the arrays in `data.path`; metric `accuracy`."""
  metric_names = ("accuracy",)

  def __init__(self, config):
    super().__init__(config)
    path = config.data.path
    if not path:
      raise errors.ConfigError("`data.path` is empty; set it to your .npz file, e.g. "
                               "--config.data.path=/data/mine.npz")
    if config.model not in MODELS:
      raise errors.ConfigError(f"`model`={config.model!r} unknown for `task`=npz_classification; "
                               f"allowed: {', '.join(MODELS)}")
    if not os.path.isfile(path):
      raise errors.DataError(f"`data.path`={path!r} is not a file")
    try:
      with np.load(path, allow_pickle=False) as npz:
        self._arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError) as e:
      raise errors.DataError(f"`data.path`={path!r} is not a readable .npz file "
                             f"({type(e).__name__})") from None
    x, y = self._split("train")
    if len(y) == 0:
      raise errors.DataError(f"`data.path` {self._key('labels', 'train')} is empty; training "
                             "needs at least one example")
    self._check_labels(y, "train")
    self.num_classes = int(config.data.num_classes or y.max() + 1)
    self.input_shape = x.shape[1:]
    self._check_split("train")
    if self._key("features", "test") in self._arrays:
      self._check_split("test")
    if config.model == "small_cnn" and len(self.input_shape) not in (2, 3):
      raise errors.DataError(f"`model`=small_cnn needs images [N, H, W(, C)]; x has shape {x.shape}")

  def _check_labels(self, y, split: str):
    """Labels are integers >= 0 of shape [N] (float labels would be truncated silently)."""
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1 or (len(y) and y.min() < 0):
      raise errors.DataError(f"`data.path` {self._key('labels', split)} must be integers >= 0 "
                             f"of shape [N]; got {y.dtype} {y.shape}")

  def _check_split(self, split: str):
    """Checks one split against the training split before anything is computed, so that a bad
    test split fails at start, not after training."""
    x, y = self._split(split)
    self._check_labels(y, split)
    if len(y) and y.max() >= self.num_classes:
      raise errors.DataError(f"`data.path` {self._key('labels', split)} span [0, {y.max()}] but "
                             f"the classes are 0..{self.num_classes - 1} (`data.num_classes`="
                             f"{self.config.data.num_classes or 'from the training labels'})")
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
      raise errors.DataError(f"`data.path` {self._key('features', split)} must hold numbers; "
                             f"got dtype {x.dtype}")
    if len(x) != len(y):
      raise errors.DataError(f"`data.path` {self._key('features', split)} has {len(x)} rows but "
                             f"{self._key('labels', split)} has {len(y)}")
    if x.shape[1:] != self.input_shape:
      raise errors.DataError(f"`data.path` {self._key('features', split)} has examples of shape "
                             f"{x.shape[1:]}; the training examples are {self.input_shape}")

  def _key(self, kind: str, split: str) -> str:
    return f"{self.config.data[kind + '_key']}_{split}"

  def _split(self, split: str):
    names = [self._key("features", split), self._key("labels", split)]
    missing = [n for n in names if n not in self._arrays]
    if missing:
      raise errors.DataError(f"`data.path`={self.config.data.path!r} lacks {missing[0]!r}; it "
                             f"holds {sorted(self._arrays)}")
    return self._arrays[names[0]], self._arrays[names[1]]

  def build_model(self):
    shape = tuple(self.input_shape)
    if self.config.model == "small_cnn" and len(shape) == 2:
      shape = shape + (1,)
    return models.classifier(self.config.model, shape, self.num_classes,
                             self.config.mixed_precision)

  def _data(self, split: str) -> dict:
    x, y = self._split(split)
    x = x.astype(np.float32) / (255.0 if x.dtype == np.uint8 else 1.0)
    if self.config.model == "small_cnn" and x.ndim == 3:
      x = x[..., None]
    return {"x": x, "y": y.astype(np.int64)}

  def train_data(self):
    return self._data("train")

  def eval_data(self):
    if self._key("features", "test") not in self._arrays:
      return None
    return self._data("test")

  def per_example_loss(self, model, batch, training):
    return models.softmax_classification(model(batch["x"], training=training), batch["y"])
