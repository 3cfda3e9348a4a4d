"""Text classification with a small Transformer on generated token sequences.

The shipped example of a task that is not images: `configs/text_transformer.py`. Each example is
`text.sequence_length` tokens drawn uniformly from 1..vocab_size-1; the label says whether the
token `text.target_token` occurs in it (inserted into half of the sequences, so the classes are
balanced). The model (`models.text_transformer`) is Embedding -> MultiHeadAttention + residual +
LayerNormalization -> Dense -> mean over tokens -> 2 logits. The data are plain numpy arrays: the
random-access path of the public API. Eager at construction; `per_example_loss` is traced.
"""
import numpy as np

from trainer import base_task
from trainer import errors
from trainer.tasks import models


def generate(num_examples: int, vocab_size: int, sequence_length: int, target_token: int,
             seed: int) -> dict:
  """{"tokens": int32 [N, T], "label": int64 [N]}; deterministic in `seed`."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, vocab_size, (num_examples, sequence_length))
  tokens[tokens == target_token] = (target_token % (vocab_size - 1)) + 1  # No accidental hits.
  label = rng.randint(0, 2, num_examples)
  where = rng.randint(0, sequence_length, num_examples)
  tokens[label == 1, where[label == 1]] = target_token
  return {"tokens": tokens.astype(np.int32), "label": label.astype(np.int64)}


class TextClassification(base_task.Task):
  """Does the sequence contain `text.target_token`? Softmax cross-entropy; metric `accuracy`."""
  metric_names = ("accuracy",)

  def __init__(self, config):
    super().__init__(config)
    text = config.text
    if not 2 < text.vocab_size:
      raise errors.ConfigError(f"`text.vocab_size`={text.vocab_size} must be > 2")
    if not 0 < text.target_token < text.vocab_size:
      raise errors.ConfigError(f"`text.target_token`={text.target_token} must be in "
                               f"1..{text.vocab_size - 1}")
    for field in ("sequence_length", "embedding_dim", "num_heads", "key_dim", "train_examples",
                  "test_examples"):
      if text[field] < 1:
        raise errors.ConfigError(f"`text.{field}`={text[field]} must be an integer >= 1")

  def build_model(self):
    text = self.config.text
    return models.text_transformer(text.vocab_size, text.sequence_length, 2,
                                   embedding_dim=text.embedding_dim, num_heads=text.num_heads,
                                   key_dim=text.key_dim, dtype=self.config.mixed_precision)

  def _arrays(self, size: int, seed: int) -> dict:
    text = self.config.text
    return generate(size, text.vocab_size, text.sequence_length, text.target_token, seed)

  def train_data(self):
    return self._arrays(self.config.text.train_examples, 1)

  def eval_data(self):
    return self._arrays(self.config.text.test_examples, 2)

  def per_example_loss(self, model, batch, training):
    return models.softmax_classification(model(batch["tokens"], training=training), batch["label"])
