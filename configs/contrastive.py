"""InfoNCE with in-batch negatives on Fashion-MNIST pairs, 256 negatives at the memory of 32.

Two views of each image (the image, and the image plus a fixed noise pattern chosen by its stream
position) through one small-CNN embedder; every other example of the UPDATE is a negative: 8
micro-batches of 32, exact with `accumulation.mode=gradcache` (trainer/gradcache.py,
docs/accumulation.md). Expected: the pair accuracy (does an image pick its own second view among
256?) rises towards 1.

Command lines:
  python -m trainer.main --config=configs/contrastive.py --workdir=/tmp/contrastive
  python -m trainer.main --config=configs/contrastive.py:smoke --workdir=/tmp/contrastive_smoke
"""
from trainer import config_defaults


def get_config(arg: str = ""):
  config = config_defaults.base_config()
  config.task = "contrastive_pairs"
  config.model = "small_cnn"
  config.accumulation.mode = "gradcache"
  config.batch_size = 32
  config.accumulation.steps = 8
  config.eval_batch_size = 256
  config.train_steps = 200
  config.steps_per_loop = 50
  config.eval_every = 200
  config.checkpoint_every = 100
  config.triplet.embedding_dim = 64
  config.contrastive.temperature = 0.1
  config.optimizer.name = "adam"
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 10
  config = config_defaults.apply_variant_args(config, arg)
  if "smoke" in config_defaults.parse_args(arg):
    config.accumulation.steps = 4
  return config
