"""A Transformer text classifier on generated token sequences: the non-image example task.

Each example is 16 tokens from a 1,000-token vocabulary; the label says whether token 7 occurs
(`trainer/tasks/text.py`). The model: Embedding(1000, 32) -> MultiHeadAttention(2 heads,
key_dim 16) + residual + LayerNormalization -> Dense(32) -> mean over tokens -> 2 logits.
Accumulation of 4 micro-batches of 64 per update (an effective batch of 256), AdamW 3e-3 with
warm-up and cosine decay, clipping at 1.0; 300 updates. Expected: test accuracy close to 1.0
(the task is learnable: attention finds the token). A SavedModel lands in workdir/export/.

Command lines:
  python -m trainer.main --config=configs/text_transformer.py --workdir=/tmp/text
  python -m trainer.main --config=configs/text_transformer.py --workdir=/tmp/text \
      --config.strategy=mirrored --config.cpu_replicas=2
  python -m trainer.main --config=configs/text_transformer.py:smoke --workdir=/tmp/text_smoke
"""
from trainer import config_defaults


def get_config(arg: str = ""):
  config = config_defaults.base_config()
  config.task = "text_classification"
  config.batch_size = 64
  config.accumulation.steps = 4
  config.eval_batch_size = 256
  config.train_steps = 300
  config.steps_per_loop = 50
  config.eval_every = 300
  config.checkpoint_every = 100
  config.optimizer.name = "adamw"
  config.optimizer.learning_rate = 3e-3
  config.optimizer.weight_decay = 0.01
  config.optimizer.warmup_steps = 20
  config.optimizer.decay = "cosine"
  config.optimizer.global_clipnorm = 1.0
  config = config_defaults.apply_variant_args(config, arg)
  if "smoke" in config_defaults.parse_args(arg):
    config.text.train_examples, config.text.test_examples = 1024, 256
  return config
