"""Two signals, and a stop under way (docs/robustness.md): the second signal changes nothing but
what the table says it does. `shutdown`'s handler is driven directly with this process' own
signal actions untouched, and one real trainer gets both signals at once.

Found on 2026-12-03: SIGINT and SIGTERM together before training gave a traceback and exit 1,
and a Ctrl-C after a SIGTERM while training dropped the SIGTERM's checkpoint.
"""
import logging
import signal
import time

import pytest

from test_robustness import _finish  # pylint: disable=g-bad-import-order
from test_robustness import _popen
from test_robustness import DETERMINISTIC
from trainer import exit_codes


def test_sigint_and_sigterm_together_stop_once_with_the_first_code(tmp_path):
  """The second signal lands while the first one's stop unwinds: it changes nothing (it used to
  raise a second StopRequested out of the handler of the first: a traceback and exit 1)."""
  proc = _popen(tmp_path, "train_steps=100000", *DETERMINISTIC)
  _wait_until_handled(proc)  # From the first statement of trainer/main.py, long before training.
  proc.send_signal(signal.SIGINT)
  proc.send_signal(signal.SIGTERM)
  code, err = _finish(proc, timeout=60)
  assert code == exit_codes.INTERRUPTED_EXIT_CODE, err[-2000:]
  assert err.strip().splitlines()[-1].startswith("microstep: error: stopped by SIGINT"), err[-2000:]
  assert "Traceback" not in err


def _wait_until_handled(proc, timeout=60):
  """Waits until the process catches SIGINT and SIGTERM (Linux: SigCgt in /proc/PID/status)."""
  wanted = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and proc.poll() is None:
    with open(f"/proc/{proc.pid}/status") as status:
      caught = next(int(l.split()[1], 16) for l in status if l.startswith("SigCgt:"))
    if caught & wanted == wanted:
      return
    time.sleep(0.005)
  raise AssertionError("the trainer never installed its signal handlers")


@pytest.fixture
def handlers(monkeypatch):
  """`shutdown`'s handler driven directly, with this process' real signal actions untouched:
  returns {signal: the action `shutdown` set last}."""
  from trainer import shutdown  # pylint: disable=g-import-not-at-top
  actions = {}
  monkeypatch.setattr(signal, "signal", lambda signum, action: actions.__setitem__(signum, action))
  monkeypatch.setitem(shutdown._state, "requested", None)  # pylint: disable=protected-access
  monkeypatch.setitem(shutdown._state, "deferred", 0)  # pylint: disable=protected-access
  monkeypatch.setitem(shutdown._state, "received", None)  # pylint: disable=protected-access
  monkeypatch.setitem(shutdown._state, "exiting", False)  # pylint: disable=protected-access
  monkeypatch.setitem(shutdown._state, "exit_on_stop", 0)  # pylint: disable=protected-access
  return shutdown, actions


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_lost_inside_a_destructor_still_ends_the_process_or_the_training(handlers,
                                                                                 monkeypatch):
  """A handler that runs inside a `__del__` (TensorFlow's objects have many) raises into
  Python's "Exception ignored" and the stop is lost: an evaluator ran on after its SIGTERM until
  SIGKILL (a full test run, 2026-12-08). Outside training a backstop now ends the process with
  the stop's line and code; inside it, the loop end acts on the signal, which is noted."""
  shutdown, _ = handlers
  ended, said = [], []
  monkeypatch.setattr(shutdown.os, "_exit", ended.append)
  monkeypatch.setattr("trainer.flag_errors.say", said.append)
  monkeypatch.setattr(shutdown, "_BACKSTOP_S", 0.05)

  class Dying:
    def __del__(self):
      shutdown._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
  with shutdown.exit_on_stop():
    Dying()  # Dropped at once: its __del__ raises the stop, which Python only prints.
    assert shutdown.requested() == signal.SIGTERM
    deadline = time.time() + 10
    while not ended and time.time() < deadline:
      time.sleep(0.01)
  assert ended == [exit_codes.PREEMPTED_EXIT_CODE]
  assert said == ["stopped by SIGTERM with nothing unsaved; rerun the same command to continue"]
  # Inside training (deferred), a lost stop of an `at_once` block leaves the loop end to act.
  monkeypatch.setitem(shutdown._state, "requested", None)  # pylint: disable=protected-access
  monkeypatch.setitem(shutdown._state, "exiting", False)  # pylint: disable=protected-access
  ended.clear()
  with shutdown.exit_on_stop(), shutdown.deferred():
    with shutdown.at_once(lambda name: f"stopped by {name} in the block"):
      Dying()
    time.sleep(0.3)
    assert shutdown.requested() == signal.SIGTERM and ended == []


def test_a_block_with_nothing_unsaved_stops_at_once_inside_training(handlers, monkeypatch):
  """`at_once` (an evaluation whose update is checkpointed): a signal stops in the block, with
  the block's line and the signal's exit code (and is noted, in case the raise is lost); one
  noted before it stops at its start; after the block, signals are noted again."""
  shutdown, _ = handlers
  describe = lambda name: f"stopped by {name} in the block"
  with shutdown.deferred():
    for signum, code in ((signal.SIGINT, exit_codes.INTERRUPTED_EXIT_CODE),
                         (signal.SIGHUP, exit_codes.PREEMPTED_EXIT_CODE)):
      monkeypatch.setitem(shutdown._state, "requested", None)  # pylint: disable=protected-access
      with pytest.raises(shutdown.StopRequested) as stopped:
        with shutdown.at_once(describe):
          shutdown._handle(signum, None)  # pylint: disable=protected-access
      assert stopped.value.exit_code == code
      assert str(stopped.value) == f"stopped by {signal.Signals(signum).name} in the block"
      assert shutdown.requested() == (signal.SIGINT if signum == signal.SIGINT
                                      else signal.SIGTERM)
    monkeypatch.setitem(shutdown._state, "requested", None)  # pylint: disable=protected-access
    shutdown._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
    assert shutdown.requested() == signal.SIGTERM  # Noted: the loop end saves, then stops.
    with pytest.raises(shutdown.StopRequested) as stopped:
      with shutdown.at_once(describe):
        pass
    assert str(stopped.value) == "stopped by SIGTERM in the block"


def test_while_training_a_sigint_after_a_sigterm_keeps_the_sigterm_stop(handlers):
  shutdown, actions = handlers
  with shutdown.deferred():
    shutdown._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
    shutdown._handle(signal.SIGINT, None)  # pylint: disable=protected-access
    shutdown._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
  assert shutdown.requested() == signal.SIGTERM  # Checkpoint, then exit 42.
  assert actions[signal.SIGTERM] == signal.SIG_IGN


def test_while_training_a_sigterm_after_a_sigint_makes_it_a_sigterm_stop(handlers):
  """Exit 42, which launchers restart, as across workers; also what both signals within one
  Orbit loop give (Python handles SIGINT first)."""
  shutdown, _ = handlers
  with shutdown.deferred():
    shutdown._handle(signal.SIGINT, None)  # pylint: disable=protected-access
    shutdown._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
  assert shutdown.requested() == signal.SIGTERM


def test_a_second_ctrl_c_while_training_stops_at_once_and_says_what_is_lost(handlers):
  shutdown, actions = handlers
  with shutdown.deferred():
    shutdown._handle(signal.SIGINT, None)  # pylint: disable=protected-access
    with pytest.raises(shutdown.StopRequested) as stopped:
      shutdown._handle(signal.SIGINT, None)  # pylint: disable=protected-access
  assert stopped.value.exit_code == exit_codes.INTERRUPTED_EXIT_CODE
  assert "second SIGINT" in str(stopped.value) and "not saved" in str(stopped.value)
  # From the stop on, neither signal does anything (the process is ending with this code).
  assert actions[signal.SIGINT] is actions[signal.SIGTERM] is shutdown._ignore  # pylint: disable=protected-access


def test_a_signal_before_training_stops_at_once_and_later_signals_change_nothing(handlers,
                                                                                monkeypatch):
  shutdown, actions = handlers
  def ended(code):  # The process would end here, without Python's finalisation.
    raise SystemExit(code)
  monkeypatch.setattr(shutdown.os, "_exit", ended)
  with pytest.raises(shutdown.StopRequested) as stopped:
    shutdown._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
  assert stopped.value.exit_code == exit_codes.PREEMPTED_EXIT_CODE
  assert str(stopped.value) == ("stopped by SIGTERM with nothing unsaved; rerun the same command "
                                "to continue")
  assert actions[signal.SIGINT] is actions[signal.SIGTERM] is shutdown._ignore  # pylint: disable=protected-access
  with pytest.raises(SystemExit) as exited:
    with shutdown.exit_on_stop():
      raise stopped.value
  assert exited.value.code == exit_codes.PREEMPTED_EXIT_CODE
  assert actions[signal.SIGINT] == actions[signal.SIGTERM] == signal.SIG_IGN


def test_a_stop_after_an_evaluation_names_the_checkpoint_of_its_update(handlers, caplog):
  """A SIGTERM noted during the evaluation that follows a loop's own save: the save of the stop
  finds the update saved (`save` returns None), and the log said `saved None` (a probe)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import preemption  # pylint: disable=g-import-not-at-top
  shutdown, _ = handlers

  class SavedAlready:
    latest_checkpoint = "/w/checkpoints/ckpt-4"

    def save(self, **unused_kwargs):
      return None
  watcher = preemption.PreemptionWatcher(tf.distribute.get_strategy(), SavedAlready(),
                                         tf.Variable(4, dtype=tf.int64))
  with shutdown.deferred():
    shutdown._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
  written = []
  with caplog.at_level(logging.WARNING), pytest.raises(shutdown.StopRequested) as stopped:
    watcher.action(written.append)({"accuracy": 0.5})
  assert "stopping: saved /w/checkpoints/ckpt-4 at update 4" in caplog.text
  assert str(stopped.value) == ("stopped by SIGTERM; checkpoint written at update 4, rerun to "
                                "resume")
  # The evaluation's results reach its summaries before the stop (Orbit writes them after its
  # actions: they were computed, then lost).
  assert written == [{"accuracy": 0.5}]


def test_a_signal_noted_after_the_last_loop_stops_before_what_follows_training(handlers):
  """Noted during the final evaluation or save, after the last loop end's check: the export then
  ran deaf to it (SIGTERM is ignored once noted) and the run exited 0 (a probe, 2026-12-07)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import preemption  # pylint: disable=g-import-not-at-top
  shutdown, _ = handlers

  class Manager:
    latest_checkpoint = None

    def save(self, checkpoint_number, **unused_kwargs):
      return f"/w/checkpoints/ckpt-{checkpoint_number}"
  watcher = preemption.PreemptionWatcher(tf.distribute.get_strategy(), Manager(),
                                         tf.Variable(40, dtype=tf.int64))
  with pytest.raises(shutdown.StopRequested) as stopped:
    with watcher.installed():
      shutdown._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
  assert stopped.value.exit_code == exit_codes.PREEMPTED_EXIT_CODE
  assert str(stopped.value) == ("stopped by SIGTERM; checkpoint written at update 40, rerun to "
                                "resume")
  shutdown._state["requested"] = None  # pylint: disable=protected-access  (The fixture's.)
  written = []
  with watcher.installed():  # Nothing noted: the block ends quietly.
    watcher.action(written.append)({"loss": 1.0})
  assert not written  # Orbit writes a loop's output itself when no stop cuts its loop short.
