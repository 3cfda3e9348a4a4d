"""One line for the errors that a training or evaluation step raises, without TF's stack.

`explained(workdir, training)` wraps the Controller's calls (eager, host). Inside a step the
errors are TensorFlow's, raised from traced code in replica context: a batch the model or the
loss cannot take, a record the input pipeline cannot read, an empty training stream, variables
made anew in every trace, a multi-worker peer gone. Each becomes a `trainer.errors` error (or
`PeerLostError`) whose message names the cause and, for input errors, the checkpoint to resume
from. Anything else passes through unchanged.
"""
import contextlib
import os
import re
import sysconfig

import tensorflow as tf

from trainer import checkpointing
from trainer import errors
from trainer import preemption


@contextlib.contextmanager
def explained(workdir: str, training: bool):
  """Re-raises the step errors named in the module docstring as one-line errors."""
  try:
    yield
  except tf.errors.OutOfRangeError as e:
    if not training or checkpointing.storage_write_failure(e, workdir):
      raise  # (A write past a file-size limit is an OutOfRangeError too: EFBIG.)
    raise errors.DataError(  # The training stream repeats: it ends only if it is empty.
        "the training data yields no batch: the tf.data source is empty (e.g. a filter drops "
        "every example), on this worker at least (its shard)") from None
  except tf.errors.InvalidArgumentError as e:
    raise errors.DataError(_invalid_batch(e, workdir)) from None
  except tf.errors.UnimplementedError as e:
    # Only a cast the batch's dtype cannot take (string labels into a Keras loss) is the data's;
    # another (a deterministic kernel, an op the device lacks) keeps TensorFlow's message.
    if not _UNCASTABLE.search(e.message or "") and not _INPUT_NODE.search(e.message or ""):
      raise
    raise errors.DataError(_invalid_batch(e, workdir)) from None
  except TypeError as e:
    mixed = _HALF_MEETS_FLOAT32.search(str(e))
    if not mixed:
      _raise_from_user_code(e)
      raise
    where = _FRAME.findall(str(e))
    at = f" ({os.path.basename(where[-1][0])}:{where[-1][1]} in {where[-1][2]})" if where else ""
    raise errors.TaskError(
        f"{mixed.group(0)}{at}: under a mixed precision policy Keras layers compute and return "
        f"{mixed.group(1) if mixed.group(1) != 'float32' else mixed.group(2)}; give the model's "
        "last layer dtype='float32' (Keras' mixed precision guide), or cast its output with "
        "tf.cast(..., tf.float32) before the loss") from None
  except ValueError as e:
    rejected = _INCOMPATIBLE_INPUT.search(str(e))
    if rejected:  # Keras' input check, at trace time.
      raise errors.DataError(
          f"the model rejects the batch's shape: {rejected.group(0).strip()} (each field must "
          "have the shape of the model's input plus a leading batch axis; a tf.data source "
          "must yield single examples, which microstep batches: one batched already gets a "
          "second batch axis)") from None
    if "only supports singleton tf.Variables" not in str(e):  # (TF's words for a variable
      _raise_from_user_code(e)                                 # made anew in every trace.)
      raise
    raise errors.TaskError(
        "the task creates variables inside the training or evaluation step, anew in every "
        "trace (e.g. a Keras layer made inside per_example_loss, or `keras.random.normal"
        "(shape)` without a seed under a distribution strategy); make them in build_model "
        "(a keras.random.SeedGenerator stored on the model for random ops)") from None
  except (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.PermissionDeniedError,
          tf.errors.UnknownError) as e:
    if not _INPUT_NODE.search(e.message or ""):
      raise
    raise errors.DataError(_unreadable_input(e, workdir)) from None
  except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
          tf.errors.CancelledError) as e:
    raise preemption.PeerLostError(
        f"a multi-worker peer stopped answering ({type(e).__name__}); restart all workers to "
        f"resume from the last checkpoint") from e


_UNCASTABLE = re.compile(r"Cast \w+ to \w+ is not supported")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')
_MICROSTEP = os.path.dirname(os.path.abspath(__file__))
# Not the task's own: microstep, installed packages, Python's standard library (a TypeError
# raised inside `dataclasses.replace` named dataclasses.py; a probe, 2026-12-07).
_NOT_THE_TASKS = tuple(os.path.realpath(p) + os.sep for p in {
    _MICROSTEP, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})


def _user_frame(text: str):
  """(file, line, function) of the deepest frame in a traced error's "in user code" listing that
  is the task's own (not microstep's, an installed package's, the standard library's, nor
  `<frozen ...>`), or None."""
  for path, line, function in reversed(_FRAME.findall(text)):
    path_abs = os.path.realpath(path)
    if not path.startswith("<") and not path_abs.startswith(_NOT_THE_TASKS) and not re.search(
        r"[/\\](site|dist)-packages[/\\]", path_abs):
      return path, line, function
  return None


def _raise_from_user_code(error: Exception) -> None:
  """A ValueError or TypeError raised while tracing the task's own code (e.g. a Keras loss given
  labels of another shape than the logits: a 40-line traceback, exit 1, found by a probe on
  2026-12-07) becomes one TaskError line with the task's file and line, raised from the error
  (the command line's `--traceback` prints it). Returns when the error is microstep's own or
  no frame of the task is listed: the caller re-raises it unchanged."""
  text = str(error)
  frame = _user_frame(text)
  if isinstance(error, errors.MicrostepError) or frame is None:
    return
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  cause = lines[-1] if lines else type(error).__name__
  if not cause.startswith(type(error).__name__):
    cause = f"{type(error).__name__}: {cause}"
  path, line, function = frame
  raise errors.TaskError(f"the task's {function} fails ({os.path.basename(path)}:{line}): "
                         f"{cause}") from error  # Its traceback: `--traceback`.


# TF's error for a bfloat16 or float16 tensor met by a float32 one (or the reverse) in one op: a
# model under mixed precision whose output is not float32, met by float32 labels in the loss.
_HALF_MEETS_FLOAT32 = re.compile(r"(?:Input '\w+' of '\w+' Op )?has type (b?float16|float32) "
                                 r"that does not match type (?!\1)(b?float16|float32)")


# Keras' error for an input that does not fit a layer's input spec (e.g. `Input((T, 12))` fed
# [B, b, T, 12] by a source that batched its examples itself).
_INCOMPATIBLE_INPUT = re.compile(
    r'Input \d+ of layer "[^"]+" is incompatible with the layer: [^\n\x1b]+'
    r"|Expected shape \([^)]*\), but input has incompatible shape \([^)]*\)")


# TF's error when Dataset.batch meets examples of different shapes.
_UNEVEN_SHAPES = re.compile(
    r"component \d+\. First element had shape \[[^\]]*\] and element \d+ had shape \[[^\]]*\]")


# Several replicas (or devices) that fail in one step: TF lists each root error, indented, as
# `  (0) INVALID_ARGUMENT: text`, and ends with `N derived errors ignored.`
_FIRST_ROOT_ERROR = re.compile(r"^\s+\(0\) [A-Z_]+:\s*(\S.*)$", re.MULTILINE)


def _said(message: str) -> str:
  """What a TensorFlow op error says, without its stack: the first root error's text when
  several replicas failed, else the last line of `message` that is neither indented (TF's node
  list, a Python traceback's frames) nor TF's preamble (for an error of Python code in a tf.data
  function, that is the Python exception's own line)."""
  root = _FIRST_ROOT_ERROR.search(message)
  if root:
    return root.group(1).strip()
  said = [line for line in message.splitlines() if line.strip() and not line[0].isspace()
          and not line.startswith(("Graph execution error", "Detected at node"))]
  return (said[-1] if said else message.strip().splitlines()[-1]).strip()


def _invalid_batch(error, workdir: str) -> str:
  """One line for an InvalidArgumentError of a step or of its input pipeline."""
  message = error.message or str(error)
  ours = re.search(r"^trainer\.errors\.\w+: (.+)$", message, re.MULTILINE)
  if ours:  # A microstep error raised inside the input pipeline (`sources._column`).
    return ours.group(1).strip()
  uneven = _UNEVEN_SHAPES.search(message)
  if uneven:
    return (f"a tf.data source yields examples of different shapes ({uneven.group(0)}, in the "
            "order of the example's sorted keys); examples are batched as they come: pad or crop "
            "every example to one shape in the source (e.g. with .map), padding tokens weighted 0")
  if _INPUT_NODE.search(message):  # E.g. a record that does not parse, the source's assertion.
    return _unreadable_input(error, workdir)
  return _rejected_batch(message)


def _rejected_batch(message: str) -> str:
  """One line from a TensorFlow op error raised by a step (a label outside the classes, an id
  outside an Embedding's vocabulary): the node and what it said, without TF's stack."""
  node = re.search(r"Detected at node '?([^'\s]+)", message)
  text = _said(message)
  assertion = re.match(r"assertion failed: \[(.*?)\](?: \[|\s*$)", text)
  if assertion:  # A tf.debugging assertion (the task's, or microstep's own checks): its message.
    return assertion.group(1).strip()
  if len(text) > 240:
    text = text[:240] + " ..."
  where = f" at {node.group(1)}" if node else ""
  return (f"TensorFlow rejected a batch{where}: {text} (the data's values do not fit the model "
          "or the loss: e.g. labels outside the classes, token ids outside the vocabulary, "
          "strings where numbers belong)")


# An error raised while the input pipeline produced a batch: a node of the iterator, or a
# transformation of the tf.data source named in TF's message.
# (A Python error in `Dataset.from_generator` names its PyFunc node, then the iterator's as
# `[[while/body/_1/IteratorGetNext]]`: it read as a batch the model rejects; a probe, 2026-12-07.)
_INPUT_NODE = re.compile(r"\{\{node (?:\S*/)?IteratorGetNext\w*\}\}|Iterator::"
                         r"|\[\[(?:\S*/)?IteratorGetNext\w*\]\]")
_IN_TF_DATA_FUNCTION = re.compile(
    r"^Error in user-defined function passed to \S+ transformation with iterator: \S+: ")
_PYTHON_EXCEPTION = re.compile(r"[A-Z]\w*(?:Error|Exception): ")
_INPUT_HINTS = {tf.errors.DataLossError: "a damaged file?", tf.errors.NotFoundError:
                "a missing file?", tf.errors.PermissionDeniedError: "no read permission?"}


def _unreadable_input(error, workdir: str) -> str:
  """One line for a batch the input pipeline could not produce: a truncated or corrupt record
  file (DataLossError), a file gone (NotFoundError), a Python error in the source's own code
  (UnknownError around its traceback): its cause, without TF's stack, and where to resume."""
  cause = " ".join(_said(error.message or str(error)).split())
  cause = _IN_TF_DATA_FUNCTION.sub("", cause)
  if not _PYTHON_EXCEPTION.match(cause):  # (A Python exception's own line names its type.)
    cause = f"{type(error).__name__}: {cause}"
  cause = errors.cut_middle(cause, 200, head=80)
  hint = _INPUT_HINTS.get(type(error))
  return (f"reading the input data failed ({cause}){'; ' + hint if hint else '.'} The latest "
          f"checkpoint is {checkpointing.latest_checkpoint(workdir) or 'none'}: fix the data "
          "and rerun to resume")
