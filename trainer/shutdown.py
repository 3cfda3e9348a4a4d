"""SIGTERM and SIGINT from the first instruction: stop with the right exit code, never lose work.

SIGHUP (the terminal closed, an ssh session dropped) is a SIGTERM here, unless `nohup` ignores it.

`install()` runs first thing in `trainer.main`, before TensorFlow is imported. From then on:

    phase                               SIGTERM                      SIGINT (Ctrl-C)
    imports, build, restore, eval,      StopRequested at once:       StopRequested at once:
    export (nothing unsaved)            exit 42                      exit 130
    training (inside `deferred()`)      noted; the trainer writes    noted; the same, exit 130
                                        a checkpoint at the end of   (a second Ctrl-C stops at
                                        the loop and exits 42        once, without it)
    an evaluation in training whose     StopRequested at once:       StopRequested at once:
    update is checkpointed (`at_once`)  exit 42                      exit 130

While training, once a stop is noted, a SIGTERM after a Ctrl-C makes it a SIGTERM stop (exit 42,
which launchers restart: as across workers, `trainer.preemption`), a Ctrl-C after a SIGTERM
changes nothing, and a second Ctrl-C stops at once, without the checkpoint (when it is handled
after the first: signals that land within one TensorFlow call, e.g. one Orbit loop, are handled
together when it returns, SIGINT before SIGTERM, and two Ctrl-C count as one). Before training,
the first signal handled stops the run. Once a stop is raised (`stop()`), both signals change
nothing until the process ends (`exit_on_stop()` in `trainer.main`): a signal that lands while
the process unwinds or exits cannot replace the stop's message or turn its exit code into -15 or
-2.

Handlers only run Python between bytecodes in the main thread: a signal that arrives inside a
long TensorFlow call is acted on when that call returns. One that runs inside a destructor has
its stop swallowed by Python ("Exception ignored in ..."): every stop a handler raises is also
noted (a training loop end acts on it), and under `exit_on_stop()` a backstop thread ends the
process `_BACKSTOP_S` later if nothing else has. The checkpoint a stop writes sits on an
update boundary like every other (`trainer.preemption`). Free of TensorFlow imports.
"""
import contextlib
import logging
import os
import signal
import sys
import threading

from trainer import exit_codes

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # (SIGHUP: unless ignored, `nohup`.)
# "requested": the stop noted while training (SIGTERM or SIGINT); "received": the signal that
# made it, for the stop's line (a SIGHUP is noted as a SIGTERM).
_state = {"deferred": 0, "requested": None, "received": None, "installed": False,
          "at_once": None, "exit_on_stop": 0, "exiting": False}
# A stop raised by a handler is lost when the handler runs inside a `__del__` or a weakref
# callback (Python prints "Exception ignored in ..." and goes on; TensorFlow's objects have many):
# a SIGTERM then left an evaluator running until SIGKILL (a full test run, 2026-12-08). Outside
# training, the process then ends this many seconds after the signal anyway.
_BACKSTOP_S = 5.0
_IDLE_MESSAGE = "with nothing unsaved; rerun the same command to continue"


class StopRequested(BaseException):
  """A SIGTERM or SIGINT asked the run to stop; `exit_code` says which (42 or 130).

  A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it.
  """

  def __init__(self, signum: int, message: str = ""):
    self.signum = signum
    self.exit_code = exit_code_for(signum)
    name = signal.Signals(signum).name
    super().__init__(message or f"stopped by {name} {_IDLE_MESSAGE}")


def exit_code_for(signum: int) -> int:
  return exit_codes.INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else (
      exit_codes.PREEMPTED_EXIT_CODE)


def _ignore(signum, frame):  # pylint: disable=unused-argument
  """The handler once a stop is raised: the process is ending with that stop's code."""


def stop(signum: int, message: str = "") -> StopRequested:
  """The StopRequested to raise now; from here on SIGTERM and SIGINT change nothing (main
  thread, eager, host). A Python handler that does nothing, rather than SIG_IGN, so that a
  signal already caught but not yet handled meets a handler (CPython reports one that meets
  SIG_IGN as a race); `exit_on_stop()` then ignores them for the exit itself."""
  try:
    for other in _SIGNALS:
      signal.signal(other, _ignore)
  except ValueError:  # Not the main thread (a library caller's run): its handlers stay.
    pass
  return StopRequested(signum, message)


def _note(signum: int, received: int) -> bool:
  """Notes `signum` as the stop a training loop end acts on (a SIGHUP as a SIGTERM: workers
  agree on those two; a SIGTERM replaces a noted SIGINT); False if the stop noted already
  stays."""
  if signum == signal.SIGHUP:
    signum = signal.SIGTERM
  noted = _state["requested"]
  if noted is None or (signum == signal.SIGTERM and noted == signal.SIGINT):
    _state["requested"], _state["received"] = signum, received
    return True
  return False


def _raise_now(signum: int, message: str = ""):
  """Raises the stop of `signum` from a handler; under `exit_on_stop()` it also starts a
  backstop that ends the process after `_BACKSTOP_S` unless it is ending already or a training
  loop has taken over (which acts on the noted signal: `_note`)."""
  error = stop(signum, message)
  if _state["exit_on_stop"]:
    backstop = threading.Timer(_BACKSTOP_S, _backstop, args=(error,))
    backstop.daemon = True
    backstop.start()
  raise error


def _backstop(error: "StopRequested") -> None:
  if not (_state["exiting"] or _state["deferred"]):
    _exit_now(error)


def _exit_now(error: "StopRequested") -> None:
  """Ends the process with the stop's one line and exit code, without Python's finalisation."""
  _state["exiting"] = True
  try:
    for other in _SIGNALS:
      signal.signal(other, signal.SIG_IGN)
  except ValueError:  # The backstop's thread: `stop()` set handlers that do nothing already.
    pass
  from trainer import flag_errors  # pylint: disable=g-import-not-at-top
  flag_errors.say(str(error))
  for handler in logging.getLogger().handlers:  # (absl's handler sits on the root logger.)
    handler.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(error.exit_code)  # pylint: disable=protected-access


@contextlib.contextmanager
def exit_on_stop():
  """A StopRequested raised in the block ends the process with its one line and exit code (the
  command line; main thread, eager, host).

  It ends at once, without Python's finalisation: the stop's checkpoint is written and the
  workdir lock released by then (Orbit's summary writer flushes as each loop ends), while
  collecting a run's TensorFlow objects took 2-43 s on a loaded 2-core machine, longer than a
  supervisor's grace between SIGTERM and SIGKILL (`timeout -k 5`: exit -9 instead of 42, which
  launchers do not restart; found by a probe, 2026-12-07). SIGTERM and SIGINT are ignored from
  the stop on, so that a late one cannot replace its message or exit code.
  """
  _state["exit_on_stop"] += 1
  try:
    yield
  except StopRequested as e:
    _exit_now(e)
  finally:
    _state["exit_on_stop"] -= 1


def _handle(signum, frame):  # pylint: disable=unused-argument
  received = signum
  if signum == signal.SIGHUP:  # The terminal closed (ssh dropped): it killed the run, with the
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # updates since the last checkpoint; stop as
    if _state["deferred"]:                          # for SIGTERM (a probe, 2026-12-07).
      signum = signal.SIGTERM  # (Noted as one: workers agree on SIGTERM and SIGINT only.)
  if signum == signal.SIGTERM:
    # A repeated SIGTERM (a supervisor and a VM shutdown alike) changes nothing from here on.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
  if not _state["deferred"] or _state["at_once"] is not None:  # Nothing unsaved: stop now.
    _note(signum, received)  # Also noted: a stop lost in a destructor (`_BACKSTOP_S`).
    _raise_now(signum, _state["at_once"](stop_name(signum)) if _state["deferred"] else "")
  if _note(signum, received):  # Training: the loop end writes a checkpoint and stops.
    return
  if signum == signal.SIGINT and _state["requested"] == signal.SIGINT:
    _raise_now(signum, "stopped at once by a second SIGINT: the updates since the last "
                       "checkpoint are not saved; rerun the same command to resume from it")


def stop_name(signum: int) -> str:
  """The name of the signal that made the stop `signum` (SIGTERM or SIGINT, as the workers
  agreed on it): SIGHUP where this process's terminal closed; else SIGINT or SIGTERM."""
  name = "SIGINT" if exit_code_for(signum) == exit_codes.INTERRUPTED_EXIT_CODE else "SIGTERM"
  if name == "SIGTERM" and _state["received"] == signal.SIGHUP:
    return "SIGHUP"
  return name


def install() -> None:
  """Installs the handlers for SIGTERM, SIGINT and SIGHUP (main thread, eager, host). SIGHUP (a
  closed terminal) stops the run as SIGTERM does, exit 42; under `nohup` it stays ignored.

  Call again after building a MultiWorkerMirroredStrategy: TensorFlow's C++ preemption notifier
  takes SIGTERM over then (while `signal.getsignal` still reports this handler).
  """
  for signum in _SIGNALS:
    if signum != signal.SIGHUP or signal.getsignal(signum) == signal.SIG_DFL:  # Not `nohup`'s.
      signal.signal(signum, _handle)
  _state["installed"] = True


def reinstall() -> None:
  """`install()` again if it ran before (the command line); library users keep their own."""
  if _state["installed"]:
    install()


@contextlib.contextmanager
def deferred():
  """Within the block a signal is only noted (`requested()`; a SIGTERM wins over a Ctrl-C); a
  second Ctrl-C after a first one stops at once."""
  _state["deferred"] += 1
  try:
    yield
  finally:
    _state["deferred"] -= 1


@contextlib.contextmanager
def at_once(describe):
  """Within `deferred()`, a block with nothing unsaved: a signal stops at once, with the line
  `describe(signal name)`; one noted before the block stops at its start. For an evaluation
  during training whose update is checkpointed: finishing it would only delay the exit, maybe
  past a supervisor's grace (a probe, 2026-12-08: 23 s after SIGTERM, SIGKILLed under
  `timeout -k 10`)."""
  if _state["requested"] is not None:
    raise stop(_state["requested"], describe(stop_name(_state["requested"])))
  previous, _state["at_once"] = _state["at_once"], describe
  try:
    yield
  finally:
    _state["at_once"] = previous


def requested():
  """The signal noted while deferred, or None."""
  return _state["requested"]


