"""Errors that the command line turns into one line on stderr and exit code 2.

Kept free of other trainer imports so that any module (and any user task) can raise them without
import cycles. `MicrostepError.ag_pass_through` asks AutoGraph to let these errors through
unchanged when they are raised while a tf.function is traced (it would otherwise wrap them in a
multi-line `StagingError`).
"""
import logging
import re


class MicrostepError(ValueError):
  """Base: a one-line message for the user; raised eagerly or while tracing."""
  ag_pass_through = True


class ConfigError(MicrostepError):
  """A config field (or the workdir, or the cluster environment) cannot be run with."""


class DataError(MicrostepError):
  """Bad or missing input data; the message is one line naming what is wrong."""


class TaskError(MicrostepError):
  """A task broke the `trainer.base_task` contract (e.g. a loss of the wrong shape)."""


def drop_replica_reports() -> None:
  """Eager, host, once per process (the command line): under Mirrored and MultiWorkerMirrored,
  TensorFlow's thread coordinator logs the traceback of an exception raised in a replica's
  function (INFO, `Error reported to Coordinator`) before it re-raises it in the caller. For a
  MicrostepError, whose one line the command line prints, that report is dropped."""
  logger = logging.getLogger("tensorflow")
  if _reports_no_microstep_error not in logger.filters:
    logger.addFilter(_reports_no_microstep_error)


def _reports_no_microstep_error(record: logging.LogRecord) -> bool:
  raised = record.exc_info[1] if record.exc_info else None
  return not isinstance(raised, MicrostepError)


def describe_error(error: BaseException) -> str:
  """`Type: message` on one line for one-line errors: the message's first line (a TensorFlow
  message's cause, e.g. `path; No space left on device`; later lines are context), without
  TensorFlow's `{{function_node ...}}` and `[Op:...]` wrapping, cut in the middle when long."""
  lines = [line for line in str(error).splitlines() if line.strip()] or [""]
  text = " ".join(lines[0].split())
  text = re.sub(r"\{\{[^}]*\}\}\s*|\s*\[Op:[^\]]*\]", "", text).strip()
  return f"{type(error).__name__}: {cut_middle(text, 160, head=60)}"


def cut_middle(text: str, limit: int, *, head: int) -> str:
  """`text` if it has at most `limit` characters, else its first `head` and its last ones
  around ` ... `, `limit` characters in all (an error's cause is often at its end)."""
  if len(text) <= limit:
    return text
  return f"{text[:head]} ... {text[len(text) - (limit - head - 5):]}"
