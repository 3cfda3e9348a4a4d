r"""Command line: `python -m trainer.main --config=configs/fashion_mnist.py --workdir=DIR`.

Override any field with `--config.FIELD=VALUE` (e.g. `--config.accumulation.steps=4`). Every
failure is one line on stderr, `microstep: error: ...`, with an exit code the launchers act on
(`trainer/exit_codes.py`): 0 done; 2 bad config, data, workdir or task; 3 too many non-finite
updates; 42 preempted (SIGTERM: checkpoint written, rerun to resume); 43 a multi-worker peer was
lost; 74 storage: a checkpoint could not be written or read, or another workdir file (a
TensorBoard summary, result.json) not written on a full or read-only disk; 130 interrupted
(Ctrl-C: checkpoint written). `--traceback` prints a failure's Python traceback before its line.

A config file outside the repository may name a task in a module beside it
(`config.task = "my_task:MyTask"`): the config file's directory is importable, as is the
working directory.
"""
from trainer import closed_output
from trainer import shutdown

shutdown.install()  # First: a signal during the imports below is already a clean stop.
closed_output.install()  # A reader of stdout or stderr that goes away does not stop the run.

# pylint: disable=g-import-not-at-top,wrong-import-position
with shutdown.exit_on_stop():  # A stop during the imports: its one line and exit code.
  import gc
  import os
  import sys

  from absl import app
  from absl import flags
  from absl import logging
  from ml_collections import config_flags

  from trainer import exit_codes
  from trainer import flag_errors

  _CONFIG = config_flags.DEFINE_config_file("config", None,
                                            "Config file, e.g. configs/fashion_mnist.py")
  _WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, summaries and config.json go here.")
  _TRACEBACK = flags.DEFINE_bool(
      "traceback", False, "On a failure, print its Python traceback (and the error it replaced, "
      "e.g. the task's own) before the one-line message.")
  flags.mark_flags_as_required(["config", "workdir"])


def _config_dir_importable(argv) -> None:
  """Puts the --config file's directory on sys.path, so it and its task can import siblings."""
  for i, arg in enumerate(argv):
    value = arg.split("=", 1)[1] if arg.startswith("--config=") else (
        argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None)
    if value:
      directory = os.path.dirname(os.path.abspath(value.split(":", 1)[0]))
      if directory not in sys.path:
        sys.path.insert(1, directory)


def main(argv):
  if len(argv) > 1:
    flag_errors.fail(f"unexpected arguments {argv[1:]}; use --config.FIELD=VALUE overrides")
  logging.set_verbosity(logging.INFO)
  import tensorflow as tf
  from trainer import checkpointing, errors, preemption, run
  errors.drop_replica_reports()
  error = code = line = stop = None  # A failure: its error, its exit code, its one line.
  try:
    run.run(_CONFIG.value, _WORKDIR.value)
  except shutdown.StopRequested as e:  # Re-raised below, without the run's frames.
    stop = e.with_traceback(None)
    stop.__context__ = None
  except errors.MicrostepError as e:
    error, code = e, exit_codes.BAD_INPUT_EXIT_CODE
  except FloatingPointError as e:
    error, code = e, exit_codes.DIVERGED_EXIT_CODE
  except preemption.PeerLostError as e:
    error, code = e, exit_codes.PEER_LOST_EXIT_CODE
  except (checkpointing.CheckpointWriteError, checkpointing.CheckpointReadError) as e:
    error, code = e, exit_codes.CHECKPOINT_IO_EXIT_CODE
  except (tf.errors.OpError, OSError) as e:  # E.g. a TensorBoard summary on a full disk.
    line = checkpointing.storage_write_failure(e, _WORKDIR.value)
    if line is None:
      raise
    error, code = e, exit_codes.CHECKPOINT_IO_EXIT_CODE
  if error is not None:  # The line now; the error goes (its frames hold the run's objects).
    line, error = flag_errors.failure_line(error, _TRACEBACK.value, line), None
  if stop:  # Its checkpoint is written: the process ends at once (`shutdown.exit_on_stop`).
    raise stop
  # The run's objects go now, while Python runs: what their destructors log (e.g. TensorFlow on
  # a checkpoint it could not restore) comes before a failure's line, which stays last; and an
  # input pipeline's destructor waits for its tf.data threads, which may be inside Python code
  # (`tf.numpy_function` of an indexable source, `from_generator`) that needs the GIL: at
  # interpreter shutdown they can never get it, and the finished process hung (a probe).
  gc.collect()
  if code is not None:
    flag_errors.fail(line, code)


def run_cli() -> None:
  """The command line: parse the flags, run, turn every failure into one line and an exit code."""
  with shutdown.exit_on_stop():
    _config_dir_importable(sys.argv)
    app.run(main, flags_parser=flag_errors.parse)


if __name__ == "__main__":
  run_cli()
