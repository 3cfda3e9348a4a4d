"""Command-line errors as one line: what absl and ml_collections raise while parsing the flags.

`parse(argv)` is the `flags_parser` of `absl.app.run` in `trainer.main`: it parses the flags,
which loads the `--config` file and applies `--config.FIELD=VALUE` overrides, and turns every
failure (a missing or broken config file, a config that raises, an unknown variant or field, a
value of the wrong type, an unknown flag) into `microstep: error: ...` and exit code 2. Eager,
host, free of TensorFlow imports.
"""
import contextlib
import importlib.util
import re
import sys
import traceback

from absl import flags

from trainer import errors
from trainer import exit_codes


def say(message: str) -> None:
  """Prints `microstep: error: ...`, one line whatever the message held, on stderr."""
  line = " ".join(str(message).split())
  print(f"microstep: error: {line}", file=sys.stderr, flush=True)


def fail(message: str, code: int = exit_codes.BAD_INPUT_EXIT_CODE):
  """Prints one line and exits (the command line's only way to report an error)."""
  say(message)
  sys.exit(code)


def failure_line(error: BaseException, show_traceback: bool, line=None) -> str:
  """The one line (`line`, else the error's text) for a failure the run raised.

  `show_traceback` (`--traceback`) first prints the error's Python traceback on stderr, with the
  error it replaced (e.g. a TensorFlow error, or the task's own ValueError). Without it, an
  error in the task's own code (a TaskError raised `from` that code's error) says how to see
  where it came from.
  """
  if show_traceback:
    error.__suppress_context__ = False  # `raise ... from None` hid the error it replaced.
    traceback.print_exception(error, file=sys.stderr)
  line = str(error) if line is None else line
  if isinstance(error, errors.TaskError) and error.__cause__ is not None and not show_traceback:
    return f"{line} (--traceback prints where)"
  return line


_HELP_FLAGS = frozenset({"help", "?", "helpshort", "helpfull", "helpxml"})


@contextlib.contextmanager
def help_exits_zero(argv):
  """absl's help flags (`--help`, `-?`, `--helpshort`, `--helpfull`, `--helpxml`) print their
  text and exit 1 from inside the flag parser; help that was asked for is a success, exit 0."""
  try:
    yield
  except SystemExit as e:
    if e.code == 1 and any(a.lstrip("-").split("=", 1)[0] in _HELP_FLAGS
                           for a in argv[1:] if a.startswith("-")):
      sys.exit(0)
    raise


def _config_arg(argv) -> str:
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return ""


def _overrides(argv) -> list:
  return [a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.")]


def _load(config_arg):
  """The config the file builds, loaded as ml_collections does (for listing field names)."""
  path, _, arg = config_arg.partition(":")
  spec = importlib.util.spec_from_file_location("microstep_config_for_errors", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def _loads(config_arg) -> bool:
  """Whether the config file builds its config without raising (no overrides applied)."""
  try:
    _load(config_arg)
  except Exception:  # pylint: disable=broad-except
    return False
  return True


def _unknown_field(argv) -> str:
  """`--config.a.b`: one line naming the first override that is not a field, and the allowed."""
  try:
    config = _load(_config_arg(argv))
  except Exception:  # pylint: disable=broad-except
    return ""
  for override in _overrides(argv):
    node, walked = config, []
    for part in override.split("."):
      if walked and not hasattr(node, "keys"):  # `--config.batch_size.x`: listed no names.
        return (f"`--config.{override}`: `{'.'.join(walked)}` is a value, not a group of "
                "fields")
      keys = list(node.keys()) if hasattr(node, "keys") else []
      if part not in keys:
        where = ".".join(walked) or "the config"
        return (f"`--config.{override}` is not a field; allowed in {where}: "
                f"{', '.join(sorted(keys))}")
      node, walked = node[part], walked + [part]
  return ""


def _not_a_config(config_arg) -> str:
  """One line when the config file's get_config returns no ConfigDict (None: a forgotten
  `return config`), else ''."""
  try:
    config = _load(config_arg)
  except Exception:  # pylint: disable=broad-except  (Described from the parse error itself.)
    return ""
  if hasattr(config, "keys"):
    return ""
  what = "None (a forgotten `return config`?)" if config is None else type(config).__name__
  return (f"`--config`={config_arg}: get_config returned {what}; it must return an "
          "ml_collections.ConfigDict")


def _describe(error, argv) -> str:
  config_arg = _config_arg(argv)
  text = str(error)
  returned = _not_a_config(config_arg) if config_arg else ""
  if returned:  # Else reported as an unknown override, or a --config "other than None".
    return returned
  if isinstance(error, SyntaxError):
    return f"`--config`={config_arg}: {error.msg} (line {error.lineno})"
  if "Failed loading config file" in text:
    reason = re.findall(r"\[Errno \d+\][^\n]*", text)
    return f"`--config`={config_arg} cannot be loaded: {reason[-1] if reason else 'no such file'}"
  if isinstance(error, (AttributeError, KeyError)):
    if _loads(config_arg):  # The file is fine by itself: an override names a missing field.
      return _unknown_field(argv) or f"`--config` override refers to an unknown field {text}"
    return f"`--config`={config_arg}: get_config raised {type(error).__name__}: {text}"
  if "Error whilst parsing config file" in text:  # get_config raised; its last line says why.
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return f"`--config`={config_arg}: {lines[-1]}"
  if isinstance(error, flags.Error):
    return text
  return f"`--config`={config_arg}: get_config raised {type(error).__name__}: {text}"


def parse(argv):
  """`absl.app.run` flags parser: parses, or fails with one line and exit code 2."""
  try:
    with help_exits_zero(argv):
      remaining = flags.FLAGS(argv)
    if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
      list(flags.FLAGS["config"].value.keys())  # A config that failed to load raises only now.
    return remaining
  except Exception as e:  # pylint: disable=broad-except
    fail(_describe(e, argv))
