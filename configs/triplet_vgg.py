"""Seed question 004: a VGG-16 triplet network, 128 micro-batches of ONE triplet per update.

Anchor, positive and negative go through one shared VGG-16-style embedder (64-d, unit norm);
hinge triplet loss on squared distances, margin 0.2. Fashion-MNIST images resized to 32x32 (five
2x2 poolings). Each optimizer update accumulates 128 micro-steps of batch 1 in SyncOnRead buffers:
exactly the update of one 128-triplet batch, at the memory of one triplet. Default: VGG-16 layout
at 1/8 width (CPU-sized); `full`: the full-width VGG-16 body (15M parameters).
Expected (docs/accumulation.md): training loss falls from ~0.2 and triplet accuracy rises.

`batch_hard`: batch-hard triplet mining over ALL 128 examples of an update (the farthest
positive and the nearest negative of each anchor), although each micro-batch holds one example:
exact with `accumulation.mode=gradcache` (docs/accumulation.md). Averaging micro-batch gradients
would see no positive at all in a micro-batch of one.

Command lines:
  python -m trainer.main --config=configs/triplet_vgg.py --workdir=/tmp/triplet
  python -m trainer.main --config=configs/triplet_vgg.py:full --workdir=/tmp/triplet_full
  python -m trainer.main --config=configs/triplet_vgg.py:batch_hard --workdir=/tmp/batch_hard
  python -m trainer.main --config=configs/triplet_vgg.py:smoke --workdir=/tmp/triplet_smoke
"""
from trainer import config_defaults


def get_config(arg: str = ""):
  config = config_defaults.base_config()
  config.task = "triplet"
  config.model = "vgg_small"
  config.data.image_size = 32
  config.batch_size = 1
  config.accumulation.steps = 128
  config.train_steps = 150
  config.steps_per_loop = 10
  config.eval_every = 50
  config.checkpoint_every = 50
  config.eval_batch_size = 500
  config.optimizer.name = "adam"
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 10
  config.triplet.margin = 0.2
  config.triplet.embedding_dim = 64
  config = config_defaults.apply_variant_args(config, arg, recipe_args=("full", "batch_hard"))
  args = config_defaults.parse_args(arg)  # Already checked by apply_variant_args.
  if "full" in args:
    config.model = "vgg16"
  if "batch_hard" in args:
    config.task = "batch_hard_triplet"
    config.accumulation.mode = "gradcache"
  if "smoke" in args:
    config.batch_size = 1
    config.train_steps = 4
    config.steps_per_loop = 2
    config.accumulation.steps = 16
  return config
