"""Seed question 002: simulate a large batch on one device by averaging micro-batch gradients.

The small CNN on the real Fashion-MNIST with an effective batch of 1,024 = 8 micro-steps of 128,
one optimizer update per 1,024 examples (exactly the update a 1,024 batch would make; see
docs/accumulation.md). Adam 4e-3 with 20 warm-up updates and cosine decay, 8 epochs = 468 updates.
Expected: about 90% test accuracy; peak memory of a 128 batch, not of a 1,024 batch.

Command lines:
  python -m trainer.main --config=configs/accumulate_cnn.py --workdir=/tmp/accumulate_cnn
  python -m trainer.main --config=configs/accumulate_cnn.py:smoke --workdir=/tmp/accumulate_smoke
"""
from trainer import config_defaults


def get_config(arg: str = ""):
  config = config_defaults.base_config()
  config.task = "classification"
  config.model = "small_cnn"
  config.batch_size = 128
  config.accumulation.steps = 8
  config.train_steps = 468           # 8 epochs of 60,000 at 1,024 per update.
  config.steps_per_loop = 58
  config.eval_every = 468
  config.checkpoint_every = 116
  config.optimizer.name = "adam"
  config.optimizer.learning_rate = 4e-3
  config.optimizer.warmup_steps = 20
  config.optimizer.decay = "cosine"
  return config_defaults.apply_variant_args(config, arg)
