"""The Orbit Controller of runs that only read checkpoints: `mode` = eval, export, continuous_eval.

Orbit's Controller restores the checkpoint that the `checkpoint` state file names: once when it
is built, and then each new one while it watches the directory. A reader cannot trust that file,
because only a training chief repairs it (`checkpointing.restore_newest_intact`). The file may
name a damaged checkpoint, one that is gone, or an older one than the newest intact `ckpt-N`: a
kill between a save's files and its state file leaves the latter. `ReadingController` therefore:
* when built, keeps what the runner restored, the newest `ckpt-N` that reads back whole
  (training resumes from the same one), instead of restoring the state file's;
* while watching (`evaluate_continuously`), evaluates that one first, then, as Orbit does, the
  newest checkpoint the state file names at each poll, until it has evaluated update
  `train_steps` (training's last), restored with `checkpointing.restore_one`:
  a damaged one is skipped with a warning (the last good one's values are restored again)
  instead of crashing the evaluator, and an older one (a stale state file) is not evaluated
  again. (Like Orbit's, it evaluates a path once: a damaged `ckpt-N` that the trainer later
  writes anew under the same name is not evaluated.)
It writes nothing to the checkpoint directory. Eager, host.
"""
from absl import logging
import orbit
import tensorflow as tf

from trainer import checkpointing


class ReadingController(orbit.Controller):
  """`orbit.Controller` for readers; `restored` is the prefix the runner restored (or None),
  `final_step()` the update training ends at, asked at each check (the larger of this run's
  `train_steps` and the trainer's own in `config.json`, which a resumed trainer may have
  raised): `evaluate_continuously` stops once it has evaluated that one, instead of waiting
  `eval_timeout_s` for a checkpoint that cannot come (the default 600 s, found by a probe)."""

  def __init__(self, *args, restored=None, final_step=None, **kwargs):
    self._restored, self._final_step = restored, final_step
    super().__init__(*args, **kwargs)

  def restore_checkpoint(self, checkpoint_path=None):
    if checkpoint_path is None:  # Orbit's restore at construction: the runner's one stands.
      return self._restored
    damage = checkpointing.restore_one(self.checkpoint_manager.checkpoint, checkpoint_path,
                                       self.strategy)
    if damage:  # Its values may be half read: back to the last good checkpoint's.
      logging.warning("skipped damaged checkpoint %s (%s)", checkpoint_path, damage)
      if self._restored:
        checkpointing.restore_one(self.checkpoint_manager.checkpoint, self._restored,
                                  self.strategy)
      return None
    self._restored = checkpoint_path
    return checkpoint_path

  def evaluate_continuously(self, steps=-1, timeout=None, timeout_fn=None):
    """Evaluates the restored checkpoint, then, at each poll, the newest one the state file
    names if it is newer and reads back whole, until it has evaluated training's last update
    (`final_step`); returns the last outputs."""
    output, newest = None, -1
    if self._restored:
      output, newest = self.evaluate(steps), _number(self._restored)
    if self._done(newest):
      return output
    for path in tf.train.checkpoints_iterator(self.checkpoint_manager.directory,
                                              timeout=timeout, timeout_fn=timeout_fn):
      if _number(path) > newest and self.restore_checkpoint(path) is not None:
        output, newest = self.evaluate(steps), _number(path)
        if self._done(newest):
          break
    if output is None:  # Exit 0 with "eval": null said nothing (a probe, 2026-12-07).
      logging.warning("continuous_eval evaluated nothing: no intact checkpoint appeared in %s "
                      "within eval_timeout_s=%s", self.checkpoint_manager.directory, timeout)
    return output

  def _done(self, evaluated: int) -> bool:
    """Whether the checkpoint of update `evaluated` is training's last one (logs it)."""
    final = None if self._final_step is None else self._final_step()
    if final is None or evaluated < final:
      return False
    logging.info("evaluated update %d, the last one (train_steps=%d): done", evaluated, final)
    return True


def _number(prefix: str) -> int:
  """N of a `.../ckpt-N` prefix."""
  return int(prefix.rsplit("-", 1)[1])
