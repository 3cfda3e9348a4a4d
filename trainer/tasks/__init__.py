"""Built-in tasks, and finding a task by name or import path.

Every built-in task is an ordinary `trainer.base_task.Task` that a user could have written; the
runner knows none of their datasets. `config.task` is a short name below or an import path
`package.module:ClassName` (the module is imported as Python imports it: from the working
directory, the config file's directory, or an installed package). Eager, host.
"""
import importlib
import importlib.util
import traceback

from trainer import errors

BUILT_IN = {
    "classification": "trainer.tasks.fashion_mnist:Classification",
    "triplet": "trainer.tasks.fashion_mnist:Triplet",
    "text_classification": "trainer.tasks.text:TextClassification",
    "npz_classification": "trainer.tasks.npz:NpzClassification",
    # Batch-level losses (base_task.BatchLossTask): exact with accumulation.mode=gradcache.
    "contrastive_pairs": "trainer.tasks.batch_losses:ContrastivePairs",
    "batch_hard_triplet": "trainer.tasks.batch_losses:BatchHardTriplet",
    "histogram_chi_square": "trainer.tasks.batch_losses:HistogramChiSquare",
}


def _message(error: Exception) -> str:
  text = error.msg if isinstance(error, SyntaxError) else str(error)
  return " ".join(text.split()) or "(no message)"


def _where(error: Exception, module_name: str) -> str:
  """`file, line N` of the error: the line a SyntaxError names, else the innermost frame in the
  module's own file (a call into a library names the module's line that made it)."""
  if isinstance(error, SyntaxError):
    return f"{error.filename}, line {error.lineno}"
  frames = traceback.extract_tb(error.__traceback__)
  try:
    spec = importlib.util.find_spec(module_name)
  except Exception:  # pylint: disable=broad-except  (A parent package that fails, too.)
    spec = None
  own = [f for f in frames if spec is not None and f.filename == spec.origin]
  frame = (own or frames or [None])[-1]
  return f"{frame.filename}, line {frame.lineno}" if frame else "no traceback"


def task_class(name: str):
  """The class named by `config.task` (a short name or `module:Class`)."""
  path = BUILT_IN.get(name, name)
  module_name, _, class_name = path.partition(":")
  if not module_name or not class_name:
    raise errors.ConfigError(
        f"`task`={name!r} unknown; allowed: {', '.join(BUILT_IN)} or an import path "
        "`package.module:ClassName`")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise errors.ConfigError(
        f"`task`={name!r}: cannot import {module_name!r} ({e}); run from the directory that "
        "holds it, put it beside the config file, or install it") from None
  except Exception as e:  # pylint: disable=broad-except  (The module's own code failed: a
    # SyntaxError, or an exception it raised on import. It was a 40-line traceback, exit 1; a
    # probe, 2026-12-08.)
    raise errors.TaskError(
        f"`task`={name!r}: importing {module_name!r} raised {type(e).__name__}: "
        f"{_message(e)} ({_where(e, module_name)})") from e
  cls = getattr(module, class_name, None)
  if cls is None:
    raise errors.ConfigError(f"`task`={name!r}: module {module_name!r} has no {class_name!r}")
  return cls


def create_task(config):
  """Instantiates the task `config.task` with the run's config (eager)."""
  return task_class(config.task)(config)
