"""Seed question 002's caveat: a chi-square between histograms, made exact under accumulation.

An MLP maps 8 features to one number; the loss compares a soft histogram of the outputs with the
histogram of the targets over the whole update (`trainer/tasks/batch_losses.py`). 16
micro-batches of 8 give ONE histogram of 128 entries with `accumulation.mode=gradcache`; plain
averaging (`--config.accumulation.mode=sum`) would average 16 histograms of 8 entries each,
whose bins are nearly empty (docs/accumulation.md has the measured gradient error).

Command lines:
  python -m trainer.main --config=configs/chi_square.py --workdir=/tmp/chi_square
  python -m trainer.main --config=configs/chi_square.py:smoke --workdir=/tmp/chi_square_smoke
"""
from trainer import config_defaults


def get_config(arg: str = ""):
  config = config_defaults.base_config()
  config.task = "histogram_chi_square"
  config.model = "mlp"
  config.accumulation.mode = "gradcache"
  config.batch_size = 8
  config.accumulation.steps = 16
  config.eval_batch_size = 512
  config.train_steps = 300
  config.steps_per_loop = 50
  config.eval_every = 300
  config.checkpoint_every = 100
  config.optimizer.name = "adam"
  config.optimizer.learning_rate = 3e-3
  return config_defaults.apply_variant_args(config, arg)
