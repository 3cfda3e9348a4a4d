"""Seed question 001: compare each example's gradient with the whole batch's, while training.

The default small CNN on the real Fashion-MNIST (batch 128, Adam 1e-3, 2 epochs) and, every 50
updates, per-example gradients of that update's batch with their statistics: each example's
cosine to the global batch gradient, per-example gradient norms, gradient diversity, and the
gradient noise scale B_simple, as TensorBoard scalars and histograms under `per_example/`
(docs/per_example.md). The statistics come from the update's own forward and backward pass
(ghost norms: nothing of size batch x parameters is formed).

Command lines:
  python -m trainer.main --config=configs/per_example_stats.py --workdir=/tmp/per_example
  tensorboard --logdir=/tmp/per_example/summaries
  python -m trainer.main --config=configs/per_example_stats.py:smoke --workdir=/tmp/pe_smoke
"""
from trainer import config_defaults


def get_config(arg: str = ""):
  config = config_defaults.base_config()
  config.task = "classification"
  config.model = "small_cnn"
  config.batch_size = 128
  config.train_steps = 938           # 2 epochs.
  config.steps_per_loop = 50
  config.eval_every = 938
  config.checkpoint_every = 469
  config.optimizer.name = "adam"
  config.optimizer.learning_rate = 1e-3
  config.per_example.every_steps = 50
  config = config_defaults.apply_variant_args(config, arg)
  if "smoke" in config_defaults.parse_args(arg):  # Already checked by apply_variant_args.
    config.per_example.every_steps = 4
  return config
