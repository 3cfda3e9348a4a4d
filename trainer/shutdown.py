"""SIGTERM and SIGINT from the first instruction: stop with the right exit code, never lose work.

`install()` runs first thing in `trainer.main`, before TensorFlow is imported. From then on:

    phase                               SIGTERM                      SIGINT (Ctrl-C)
    imports, build, restore, eval       StopRequested at once:       StopRequested at once:
    (nothing unsaved)                   exit 42                      exit 130
    training (inside `deferred()`)      noted; the trainer writes    noted; the same, exit 130
                                        a checkpoint at the end of   (a second Ctrl-C stops at
                                        the loop and exits 42; a     once)
                                        repeated SIGTERM changes
                                        nothing (ignored from the
                                        first one on)

Handlers only run Python between bytecodes in the main thread: a signal that arrives inside a
long TensorFlow call is acted on when that call returns. The checkpoint a stop writes sits on an
update boundary like every other (`trainer.preemption`). Free of TensorFlow imports.
"""
import contextlib
import signal

from trainer import exit_codes

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_state = {"deferred": 0, "requested": None, "installed": False}


class StopRequested(BaseException):
  """A SIGTERM or SIGINT asked the run to stop; `exit_code` says which (42 or 130).

  A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it.
  """

  def __init__(self, signum: int, message: str = ""):
    self.signum = signum
    self.exit_code = exit_code_for(signum)
    name = signal.Signals(signum).name
    super().__init__(message or f"stopped by {name} before training had anything to save; "
                                "rerun the same command to resume")


def exit_code_for(signum: int) -> int:
  return exit_codes.INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else (
      exit_codes.PREEMPTED_EXIT_CODE)


def _handle(signum, frame):  # pylint: disable=unused-argument
  if signum == signal.SIGTERM:
    # The run is stopping now; a repeated SIGTERM (a supervisor and a VM shutdown alike) changes
    # nothing, also while the process exits: Python restores the default action of handled
    # signals when it finalises, and a late SIGTERM would then end it as -15 instead of 42.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
  if _state["deferred"]:
    if _state["requested"] is None:
      _state["requested"] = signum  # Training: the loop end writes a checkpoint and stops.
      return
    if signum != signal.SIGINT:
      return
  raise StopRequested(signum)


def install() -> None:
  """Installs the handlers for SIGTERM and SIGINT (main thread, eager, host).

  Call again after building a MultiWorkerMirroredStrategy: TensorFlow's C++ preemption notifier
  takes SIGTERM over then (while `signal.getsignal` still reports this handler).
  """
  for signum in _SIGNALS:
    signal.signal(signum, _handle)
  _state["installed"] = True


def reinstall() -> None:
  """`install()` again if it ran before (the command line); library users keep their own."""
  if _state["installed"]:
    install()


@contextlib.contextmanager
def deferred():
  """Within the block a first signal is only noted (`requested()`); a second one stops at once."""
  _state["deferred"] += 1
  try:
    yield
  finally:
    _state["deferred"] -= 1


def requested():
  """The signal noted while deferred, or None."""
  return _state["requested"]


