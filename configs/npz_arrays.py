"""Your own arrays: classify the examples of one `.npz` file named on the command line.

The file holds `x_train`, `y_train` and optionally `x_test`, `y_test` (the layout of
`keras.datasets` files such as mnist.npz): features of any shape, integer labels 0..C-1
(`trainer/tasks/npz.py`). An MLP by default; `--config.model=small_cnn` for [N, H, W(, C)]
images. Accumulation of 4 micro-batches of 32, Adam 1e-3, 200 updates. For a different layout,
write a task (docs/tasks.md): a dict of arrays is all `train_data()` needs to return.

Command lines:
  python -m trainer.main --config=configs/npz_arrays.py --workdir=/tmp/mine \
      --config.data.path=/data/mine.npz
  python -m trainer.main --config=configs/npz_arrays.py:smoke --workdir=/tmp/mine_smoke \
      --config.data.path=/data/mine.npz
"""
from trainer import config_defaults


def get_config(arg: str = ""):
  config = config_defaults.base_config()
  config.task = "npz_classification"
  config.model = "mlp"
  config.data.path = ""         # Required: --config.data.path=FILE.npz
  config.batch_size = 32
  config.accumulation.steps = 4
  config.eval_batch_size = 256
  config.train_steps = 200
  config.steps_per_loop = 50
  config.eval_every = 200
  config.checkpoint_every = 50
  config.optimizer.name = "adam"
  config.optimizer.learning_rate = 1e-3
  return config_defaults.apply_variant_args(config, arg)
