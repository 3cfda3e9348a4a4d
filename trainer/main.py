r"""Command line: `python -m trainer.main --config=configs/fashion_mnist.py --workdir=DIR`.

Override any field with `--config.FIELD=VALUE` (e.g. `--config.accumulation.steps=4`). Exit codes:
0 done; 2 bad config or data (one line on stderr); 3 too many non-finite updates;
42 preempted (checkpoint written, rerun to resume); 43 a multi-worker peer was lost.

A config file outside the repository may name a task in a module beside it
(`config.task = "my_task:MyTask"`): the config file's directory is importable, as is the
working directory.
"""
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from trainer import exit_codes

def _config_dir_importable(argv) -> None:
  """Puts the --config file's directory on sys.path, so it and its task can import siblings."""
  for i, arg in enumerate(argv):
    value = arg.split("=", 1)[1] if arg.startswith("--config=") else (
        argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None)
    if value:
      directory = os.path.dirname(os.path.abspath(value.split(":", 1)[0]))
      if directory not in sys.path:
        sys.path.insert(1, directory)


_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/fashion_mnist.py")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, summaries and config.json go here.")
flags.mark_flags_as_required(["config", "workdir"])


def _fail(code: int, message: str):
  print(f"microstep: error: {message}", file=sys.stderr)
  sys.exit(code)


def main(argv):
  if len(argv) > 1:
    _fail(2, f"unexpected arguments {argv[1:]}; use --config.FIELD=VALUE overrides")
  logging.set_verbosity(logging.INFO)
  from trainer import errors, preemption, run  # pylint: disable=g-import-not-at-top
  try:
    run.run(_CONFIG.value, _WORKDIR.value)
  except errors.MicrostepError as e:
    _fail(2, str(e))
  except FloatingPointError as e:
    _fail(3, str(e))
  except preemption.PreemptedError as e:
    _fail(exit_codes.PREEMPTED_EXIT_CODE, str(e))
  except preemption.PeerLostError as e:
    _fail(exit_codes.PEER_LOST_EXIT_CODE, str(e))


if __name__ == "__main__":
  _config_dir_importable(sys.argv)
  app.run(main)
