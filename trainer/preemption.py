"""Preemption: SIGTERM -> checkpoint at the next loop boundary -> exit PREEMPTED_EXIT_CODE.

GCE/TPU maintenance and most schedulers send SIGTERM. The handler only sets a flag (signal
handlers must not run TF); `PreemptionWatcher`, an `orbit.Action` called eagerly after every
training loop, saves a checkpoint when the flag is up and raises `PreemptedError`. Under
MultiWorkerMirroredStrategy the flag is all-reduced (SUM > 0) first, so every worker saves the same step
together even when only one of them got the signal. A checkpoint therefore always sits on an update
boundary: the accumulation buffers are zero there and the run resumes bitwise.

`tf.distribute.experimental.PreemptionCheckpointHandler` is not used: it raises on Cloud TPU VMs
and steps per train call, while Orbit runs `steps_per_loop` updates per call; this watcher works
under every strategy. The latency is one loop (`steps_per_loop` updates).
"""
import contextlib
import signal

from absl import logging
import tensorflow as tf


class PreemptedError(RuntimeError):
  """A checkpoint was written because of SIGTERM; rerun the same command to resume."""


class PeerLostError(RuntimeError):
  """A multi-worker peer vanished mid-run (a collective failed: Unavailable, DeadlineExceeded)."""


class PreemptionWatcher:
  """Orbit train action: checkpoint and stop once SIGTERM was received (eager, cross-replica)."""

  def __init__(self, strategy, checkpoint_manager, global_step):
    self._strategy, self._manager, self._global_step = strategy, checkpoint_manager, global_step
    self._signalled = False
    self._sum_flags = None

  def _on_sigterm(self, signum, frame):  # pylint: disable=unused-argument
    self._signalled = True

  @contextlib.contextmanager
  def installed(self):
    """Installs the SIGTERM handler for the duration of the block (main thread only)."""
    previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    try:
      yield self
    finally:
      signal.signal(signal.SIGTERM, previous)

  def _anyone_signalled(self) -> bool:
    if not isinstance(self._strategy, tf.distribute.MultiWorkerMirroredStrategy):
      return self._signalled
    if self._sum_flags is None:  # Traced once: eager collectives are slow and noisy.
      self._sum_flags = tf.function(lambda flag: self._strategy.reduce(
          tf.distribute.ReduceOp.SUM, self._strategy.run(lambda: flag), axis=None))
    return bool(self._sum_flags(tf.constant(float(self._signalled))).numpy() > 0)

  def __call__(self, train_output) -> None:  # pylint: disable=unused-argument
    if not self._anyone_signalled():
      return
    step = int(self._global_step.numpy())
    path = self._manager.save(checkpoint_number=step, check_interval=False)
    logging.warning("preempted: saved %s at update %d", path, step)
    raise PreemptedError(f"preempted by SIGTERM; checkpoint written at update {step}, rerun to resume")
