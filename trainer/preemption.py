"""Stopping on request while training: checkpoint at the next loop boundary, then exit.

`trainer.shutdown` catches SIGTERM and SIGINT from the first instruction. While training, a
signal is only noted (`shutdown.deferred()`); `PreemptionWatcher`, an `orbit.Action` called
eagerly after every training loop, then saves a checkpoint and raises `shutdown.StopRequested`
(exit 42 for SIGTERM, 130 for SIGINT). Under MultiWorkerMirroredStrategy the note is
all-reduced (SUM > 0) first, so every worker saves the same update together even when only one
of them got the signal. A checkpoint therefore always sits on an update boundary: the
accumulation buffers are zero there and the run resumes bitwise. Latency: one Orbit loop
(`steps_per_loop` updates).

`tf.distribute.experimental.PreemptionCheckpointHandler` is not used: it raises on Cloud TPU VMs
and steps per train call, while Orbit runs `steps_per_loop` updates per call; this watcher works
under every strategy.
"""
import contextlib
import signal

from absl import logging
import tensorflow as tf

from trainer import shutdown


class PeerLostError(RuntimeError):
  """A multi-worker peer vanished mid-run (a collective failed: Unavailable, DeadlineExceeded)."""


class PreemptionWatcher:
  """Orbit train action: checkpoint and stop once a signal was noted (eager, cross-replica)."""

  def __init__(self, strategy, checkpoint_manager, global_step, every_loop=lambda: None):
    """`every_loop`: called first at each loop end (e.g. the workdir lock's `check_held`)."""
    self._strategy, self._manager, self._global_step = strategy, checkpoint_manager, global_step
    self._every_loop = every_loop
    self._sum_flags = None

  @contextlib.contextmanager
  def installed(self):
    """Signals are only noted inside the block; this watcher acts on them at loop ends, and once
    more when the block ends: a signal noted after the last loop's check (during the final
    evaluation or save) stops the run there, not after the export, which ran deaf to it and
    exited 0 (a probe, 2026-12-07). On an exception the block ends without that check."""
    with shutdown.deferred():
      yield self
      self._stop_if_signalled()

  def _anyone_signalled(self) -> int:
    """The noted signal number, or 0; agreed by every worker (a SIGTERM wins over SIGINT)."""
    signum = shutdown.requested() or 0
    if not isinstance(self._strategy, tf.distribute.MultiWorkerMirroredStrategy):
      return signum
    if self._sum_flags is None:  # Traced once: eager collectives are slow and noisy.
      self._sum_flags = tf.function(lambda flags: self._strategy.reduce(
          tf.distribute.ReduceOp.SUM, self._strategy.run(lambda: flags), axis=None),
                                    autograph=False)
    noted = [float(signum == signal.SIGTERM), float(signum == signal.SIGINT)]
    term, interrupt = self._sum_flags(tf.constant(noted)).numpy()
    return signal.SIGTERM if term > 0 else (signal.SIGINT if interrupt > 0 else 0)

  def action(self, write_output=lambda output: None):
    """An Orbit action for the train or the eval loop (eager, called with the loop's output).

    `write_output(output)` runs before a stop: Orbit writes a loop's summaries only after its
    actions, so the stopped loop's scalars (train loss, metrics; an evaluation's results) were
    lost from TensorBoard (a probe, 2026-12-07).
    """
    def act(output) -> None:
      self._every_loop()
      self._stop_if_signalled(lambda: write_output(output))
    return act

  def _stop_if_signalled(self, before_stop=lambda: None) -> None:
    """Saves this update and raises StopRequested if any worker noted a signal (eager, host;
    under MultiWorkerMirrored every worker calls it at the same point: it all-reduces)."""
    signum = self._anyone_signalled()
    if not signum:
      return
    before_stop()
    step = int(self._global_step.numpy())
    # None when this update is saved already (a stop noted during an evaluation that followed
    # the loop's own save).
    path = (self._manager.save(checkpoint_number=step, check_interval=False)
            or self._manager.latest_checkpoint)
    logging.warning("stopping: saved %s at update %d", path, step)
    raise shutdown.stop(signum, f"stopped by {shutdown.stop_name(signum)}; checkpoint written "
                                f"at update {step}, rerun to resume")
