"""Output whose reader went away: the run goes on.

`python -m trainer.main ... | head`, a `less` that was quit, a killed `tee` or a restarted log
collector: the next write to stdout raised BrokenPipeError inside Orbit's progress print and
killed the run, exit 1, losing the updates since the last checkpoint (with `2>&1 | head -3`
before the first one; a probe, 2026-12-07). A closed terminal fails writes with EIO alike.
`install()` wraps `sys.stdout` and `sys.stderr`: when the reader has gone, the stream's file
descriptor is pointed at /dev/null and the run carries on.
Its checkpoints, TensorBoard summaries and result.json hold what the lost lines said.

Eager, host, free of TensorFlow imports; `trainer.main` installs it before anything prints.
"""
import errno
import os
import sys


# A pipe whose reader exited (EPIPE: BrokenPipeError), a terminal that was closed (EIO).
_READER_GONE = (errno.EPIPE, errno.EIO)


def _to_devnull(stream) -> None:
  """Points `stream`'s file descriptor at /dev/null: what it still buffers, and every later
  write (also TensorFlow's C++ logging to the same descriptor), goes nowhere, without error."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, stream.fileno())
  finally:
    os.close(devnull)


class _SurvivesItsReader:
  """A text stream whose writes and flushes drop the output once its reader has gone."""

  def __init__(self, stream):
    self._stream = stream

  def write(self, text):
    try:
      return self._stream.write(text)
    except OSError as e:
      if e.errno not in _READER_GONE:
        raise
      _to_devnull(self._stream)
      return len(text)

  def flush(self):
    try:
      self._stream.flush()
    except OSError as e:
      if e.errno not in _READER_GONE:
        raise
      _to_devnull(self._stream)

  def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's own.
    return getattr(self._stream, name)


def install() -> None:
  """Wraps sys.stdout and sys.stderr (once; streams without a file descriptor are left)."""
  for name in ("stdout", "stderr"):
    stream = getattr(sys, name)
    if stream is None or isinstance(stream, _SurvivesItsReader):
      continue
    try:
      stream.fileno()
    except (AttributeError, OSError, ValueError):  # E.g. a notebook's or pytest's capture.
      continue
    setattr(sys, name, _SurvivesItsReader(stream))
