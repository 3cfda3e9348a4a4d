"""`max_skipped_fraction`: stop when too many of the last `skip_window` updates were skipped,
over a window that survives restarts.

The window is a list of (update, updates skipped so far) snapshots: one at each training loop's
end, and, when a run resumes, the run's start (update 0, none skipped) and one for each
checkpoint kept in the workdir (each holds `global_step` and `skipped_updates`). Until
2026-12-07 the snapshots lived in memory only, so a job restarted more often than every
`skip_window` updates was never checked.

Eager, on the host: `seed` once after the restore (`start` at the first loop without one),
`check` at loop ends. Under MultiWorkerMirrored every worker must stop at the same loop end, so
the snapshots read from checkpoints count only where every worker read the same ones (one
collective in `seed`).
"""
from absl import logging
import tensorflow as tf

from trainer import checkpointing

_KEYS = ("global_step/.ATTRIBUTES/VARIABLE_VALUE", "skipped_updates/.ATTRIBUTES/VARIABLE_VALUE")


def checkpoint_snapshots(directory: str, before: int) -> list:
  """(update, skipped so far) of each readable checkpoint in `directory` older than update
  `before`, oldest first; a checkpoint that cannot be read is left out."""
  found = []
  for number, prefix in checkpointing.numbered(directory):
    if number >= before:
      continue
    try:
      reader = tf.train.load_checkpoint(prefix)
      found.append(tuple(int(reader.get_tensor(key)) for key in _KEYS))
    except (tf.errors.OpError, ValueError, KeyError):  # Damaged, another format: no snapshot.
      continue
  return sorted(found)


class SkipWindow:
  """The snapshots and the check (eager, host)."""

  def __init__(self, window: int, fraction: float, cause: str):
    self.window, self.fraction, self._cause = int(window), float(fraction), cause
    self._snapshots = []

  def seed(self, strategy, directory: str, step: int, skipped: int) -> None:
    """After a restore at `step`: the run's start, the kept checkpoints' snapshots, then the
    restored one."""
    older = checkpoint_snapshots(directory, step)
    checksum = hash(tuple(older)) % (1 << 20)  # Tuples of ints hash alike in every process.
    if not checkpointing.workers_agree(strategy, checksum):
      logging.warning("the workers keep different checkpoints: `max_skipped_fraction` is "
                      "checked from update %d on, once %d updates ran", step, self.window)
      older = []
    self._snapshots = sorted({(0, 0), *older, (step, skipped)})

  def start(self, step: int, skipped: int) -> None:
    """At the first loop's begin: the run's start, unless `seed` gave the snapshots."""
    if not self._snapshots:
      self._snapshots.append((step, skipped))

  def check(self, step: int, skipped: int) -> None:
    """At a loop's end: raises FloatingPointError when more than `fraction` of the updates
    since the newest snapshot at least `window` updates old were skipped."""
    self._snapshots.append((step, skipped))
    old = [s for s in self._snapshots if s[0] <= step - self.window]
    if not old:
      return
    first_step, first_skipped = old[-1]
    self._snapshots = [s for s in self._snapshots if s[0] >= first_step]
    if (skipped - first_skipped) / max(step - first_step, 1) > self.fraction:
      raise FloatingPointError(
          f"{skipped - first_skipped} of the last {step - first_step} updates had non-finite "
          f"loss or gradients (more than `max_skipped_fraction`={self.fraction} of "
          f"`skip_window`={self.window}; {self._cause}); stopping instead of training on "
          "garbage")
