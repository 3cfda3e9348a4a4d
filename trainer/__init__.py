"""microstep: exact gradient accumulation and per-example gradients on Orbit and tf.distribute.

`trainer.train(config, workdir, task=None)` is the Python entry point (notebooks); the command
line is `python -m trainer.main`. A task is a `trainer.base_task.Task` (docs/tasks.md).
Importing this package imports nothing heavy: the launchers use `trainer.exit_codes` alone.
"""


def train(config, workdir: str, task=None) -> dict:
  """Runs `config.mode` (train, eval, export...) in `workdir`; returns the run's result dict.

  `task`: a `trainer.base_task.Task` instance; None builds `config.task`. Eager, host.
  """
  from trainer import run  # pylint: disable=g-import-not-at-top
  return run.run(config, workdir, task=task)
