"""Checkpoints: what a run saves, where, and what it resumes from. Eager, host.

    workdir/checkpoints/ckpt-N          the chief's checkpoint of update N: weights (readable
                                        `weights/000-kernel` keys), model, optimizer, counters
                                        (incl. the data position `micro_batches_seen`)
    workdir/data_state/worker_I/ckpt-N  worker I's input iterator at update N (tf.data sources
                                        with `data.resume` = iterator only)

Checkpoints are written only between updates (the accumulation buffers are zero there). TF writes a
checkpoint's files first and replaces the small `checkpoint` state file atomically afterwards, so a
save killed at any point leaves the previous checkpoint as the latest. Under
MultiWorkerMirroredStrategy every worker must save (TF requires it): non-chief workers write to a
scratch directory and everyone restores from the chief's.

An input iterator is per worker: each worker's shards, shuffle buffers and positions are its own, so
each worker keeps its own iterator checkpoints, written right after the main checkpoint with the
same number. A run resumes its iterator only from the number it restored; if that one is missing
(a crash between the two saves), it skips the consumed batches instead, with a warning.
"""
import errno
import os
import re
import time

from absl import logging
import tensorflow as tf
# The public `update_checkpoint_state` writes absolute paths only.
from tensorflow.python.checkpoint import checkpoint_management  # pylint: disable=g-direct-tensorflow-import

from trainer import errors


# What a write to a full, read-only or forbidden directory raises (TF's file system or Python's).
# Not FailedPrecondition: TF raises it for a tf.data iterator that cannot be saved (a stateful
# op in the pipeline), which is no storage problem.
# OutOfRange: TF's word for EFBIG, a file over a size limit (a probe, 2026-12-07: a save past
# `ulimit -f` read as "the training data yields no batch"); in a write it means nothing else.
STORAGE_ERRORS = (tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError,
                  tf.errors.UnknownError, tf.errors.OutOfRangeError, OSError)


class _ManagerWithDataState(tf.train.CheckpointManager):
  """A CheckpointManager that saves a worker's iterator checkpoint after each main save."""

  def __init__(self, *args, data_manager=None, data_update=None, **kwargs):
    super().__init__(*args, **kwargs)
    self._data_manager, self._data_update = data_manager, data_update
    self.before_save = lambda: None  # E.g. the workdir lock's `check_held` (trainer.run).

  def save(self, checkpoint_number=None, check_interval=True, options=None):
    self.before_save()
    try:
      path = super().save(checkpoint_number=checkpoint_number, check_interval=check_interval,
                          options=options)
      if path and self._data_manager is not None:
        number = int(path.rsplit("-", 1)[1])
        self._data_update.assign(number)
        self._data_manager.save(checkpoint_number=number, options=options)
    except (*STORAGE_ERRORS, tf.errors.NotFoundError) as e:
      if not tf.io.gfile.isdir(self.directory):  # Deleted or moved while the run wrote to it.
        raise CheckpointWriteError(
            f"cannot write a checkpoint: {self.directory} is gone (deleted or moved while the "
            f"run was writing to it; {errors.describe_error(e)}); restore it and rerun to resume from "
            "its newest checkpoint, or rerun to start over") from None
      for directory in [self.directory] + ([self._data_manager.directory]
                                           if self._data_manager is not None else []):
        remove_partial_saves(directory)  # Give back the space the failed save took.
      raise CheckpointWriteError(
          f"cannot write a checkpoint to {self.directory} ({errors.describe_error(e)}); "
          f"{storage_hint(e)} The latest checkpoint is still {self.latest_checkpoint or 'none'}: "
          "fix that and rerun to resume") from None
    return path


def remove_partial_saves(directory: str) -> None:
  """Deletes `ckpt-N_temp` directories in `directory`: TensorFlow's scratch space of a sharded
  save, left behind by a save that failed or was killed (never part of a checkpoint). Call only
  from the process that writes `directory` (the lock holder), or it may cut a live save short."""
  for path in tf.io.gfile.glob(os.path.join(directory, "ckpt-*_temp")):
    if re.fullmatch(r"ckpt-\d+_temp", os.path.basename(path)):
      try:
        tf.io.gfile.rmtree(path)
        logging.info("removed %s, the scratch files of an unfinished checkpoint save", path)
      except tf.errors.OpError as e:
        logging.warning("could not remove %s (%s)", path, errors.describe_error(e))


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(workdir, "checkpoints")


def data_state_dir(workdir: str, worker_id: int) -> str:
  return os.path.join(workdir, "data_state", f"worker_{worker_id}")


def _data_checkpoint(data_iterator, layout, update) -> tf.train.Checkpoint:
  """A worker's input state: the iterator, the batch layout it was made for and the update it
  was saved at (an int64 variable)."""
  return tf.train.Checkpoint(iterator=data_iterator, update=update,
                             layout=tf.Variable(layout, dtype=tf.int64, trainable=False))


def create_manager(checkpoint, workdir: str, *, is_chief: bool, worker_id: int, step_counter,
                   config, data_iterator=None, data_layout=()) -> tf.train.CheckpointManager:
  """The run's checkpoint manager (the chief's directory, or a worker's scratch directory).

  With `data_iterator`, each save also stores this worker's iterator under `data_state/`,
  with `data_layout` (workers, local replicas, examples per replica batch).
  """
  own_dir = checkpoint_dir(workdir) if is_chief else os.path.join(workdir,
                                                                  f"tmp_worker_{worker_id}")
  if not is_chief and tf.io.gfile.exists(own_dir):
    tf.io.gfile.rmtree(own_dir)  # Non-chief copies are scratch: always restore from the chief's.
  data_manager = data_update = None
  if data_iterator is not None:
    data_update = tf.Variable(-1, dtype=tf.int64, trainable=False)
    data_manager = tf.train.CheckpointManager(
        _data_checkpoint(data_iterator, list(data_layout), data_update),
        data_state_dir(workdir, worker_id), max_to_keep=config.keep_checkpoints + 1)
  return _ManagerWithDataState(
      checkpoint, own_dir, max_to_keep=config.keep_checkpoints if is_chief else 1,
      step_counter=step_counter, checkpoint_interval=config.checkpoint_every,
      data_manager=data_manager, data_update=data_update)


_UPDATE_KEY = "update/.ATTRIBUTES/VARIABLE_VALUE"


def restore_data_state(data_iterator, workdir: str, worker_id: int, step: int,
                       layout) -> bool:
  """Restores this worker's iterator saved at update `step`; False (with a warning) if there
  is none, it is damaged, or it was saved for another batch layout (replica count, batch size):
  the caller then skips the consumed batches instead."""
  path = os.path.join(data_state_dir(workdir, worker_id), f"ckpt-{step}")
  if not tf.io.gfile.exists(path + ".index"):
    return False
  try:
    reader = tf.train.load_checkpoint(path)
    saved = [int(v) for v in reader.get_tensor("layout/.ATTRIBUTES/VARIABLE_VALUE")]
    # Saved since 2026-12-07: a file of another update (a backup mixed by hand) replayed or
    # skipped batches silently.
    saved_at = int(reader.get_tensor(_UPDATE_KEY)) if reader.has_tensor(_UPDATE_KEY) else step
    if saved_at != step:
      logging.warning("the input iterator in %s was saved at update %d, not %d: skipping the "
                      "consumed batches instead", path, saved_at, step)
      return False
    if saved != list(layout):
      logging.warning("the input iterator of update %d was saved for (workers, replicas, batch) "
                      "= %s, not %s: skipping the consumed batches instead", step, saved,
                      list(layout))
      return False
    # (A scratch `update` takes the saved one: unmatched, TF warned of it at exit.)
    _data_checkpoint(data_iterator, list(layout), tf.Variable(-1, dtype=tf.int64)).restore(
        path).assert_existing_objects_matched()
  except (*_DAMAGE, tf.errors.OpError, AssertionError, ValueError) as e:
    logging.warning("the input iterator of update %d does not read back (%s): skipping the "
                    "consumed batches instead", step, errors.describe_error(e))
    return False
  logging.info("restored the input iterator of update %d from %s", step, path)
  return True


# ----------------------------------------------------------------- damaged checkpoints ---------
class CheckpointWriteError(RuntimeError):
  """A checkpoint could not be written (disk full, permissions); the previous one stands."""


class CheckpointReadError(RuntimeError):
  """A checkpoint could not be read for a reason other than damage (storage unavailable,
  permission denied, out of memory): nothing is moved aside; rerun when storage is back."""


# What a damaged checkpoint raises on restore (truncated, zeroed or missing files). A checkpoint
# of another model raises AssertionError/ValueError instead: that is a config change, not damage.
# Other TF errors (Unavailable, DeadlineExceeded, PermissionDenied, ResourceExhausted...) say the
# storage failed, not the files: they must not send a good checkpoint to damaged/.
_RELISTS = 10  # Times a reader lists the checkpoints again when one vanished while read.
_DELETE_GRACE_S = 0.5
_DAMAGE = (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError,
           tf.errors.InvalidArgumentError, IndexError, RuntimeError, EOFError)


def numbered(directory: str) -> list:
  """(update, prefix) of every `ckpt-N` whose index file exists, newest first."""
  found = []
  for index in tf.io.gfile.glob(os.path.join(directory, "ckpt-*.index")):
    prefix = index[:-len(".index")]
    number = prefix.rsplit("-", 1)[1]
    if number.isdigit():
      found.append((int(number), prefix))
  return sorted(found, reverse=True)


# A write that failed for want of room or write access, by text (TF errors) or errno (Python):
# not a tensor allocation (ResourceExhausted "OOM when allocating"), which is no storage problem.
_FULL_OR_READ_ONLY = ("No space left on device", "Disk quota exceeded", "Read-only file system",
                      "File too large")
_FULL_OR_READ_ONLY_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _no_permission(error: BaseException) -> bool:
  """Whether a failed write was refused for want of permission (EACCES, EPERM: `chattr +i`)."""
  return isinstance(error, tf.errors.PermissionDeniedError) or any(
      cause in str(error) for cause in ("Permission denied", "Operation not permitted"))


def storage_hint(error: BaseException) -> str:
  """A guess at the cause of a failed write, for its one-line error: `disk full?`, ..."""
  text = str(error)
  # (Before permissions: TF raises a read-only mount's EROFS as PermissionDeniedError.)
  if "Read-only file system" in text or getattr(error, "errno", None) == errno.EROFS:
    return "read-only file system?"
  if "File too large" in text or getattr(error, "errno", None) == errno.EFBIG:
    return "a limit on file size (`ulimit -f`, FAT32's 4 GiB, a quota)?"
  if _no_permission(error):
    return "no write permission?"
  if isinstance(error, tf.errors.ResourceExhaustedError) or any(
      cause in text for cause in _FULL_OR_READ_ONLY):
    return "disk full?"
  return "storage failing?"


def _names_a_path_in(text: str, workdir: str) -> bool:
  """Whether `text` names a path inside `workdir` (as given, or absolute): the directory as a
  whole path component, so `/data/exp` is not found in `/data/exp_inputs/x`, nor `.` in
  `/data/train.npz`."""
  forms = {workdir.rstrip("/")} | ({os.path.abspath(workdir)} if "://" not in workdir else set())
  return any(re.search(r"(?:^|[\s'\"(=:])" + re.escape(form + "/"), text) for form in forms)


def storage_write_failure(error: BaseException, workdir: str):
  """One line for a write to `workdir` that failed because its storage is full or read-only, or
  a file in it may not be written (a TensorBoard summary, `result.json`, ...: checkpoints and
  exports have their own lines), or None for any other error. Eager, host."""
  if not isinstance(error, (tf.errors.OpError, OSError)):
    return None
  number, text = getattr(error, "errno", None), str(error)
  full = number in _FULL_OR_READ_ONLY_ERRNOS or any(c in text for c in _FULL_OR_READ_ONLY)
  # A file the run may not write (`chattr +i`, a root-owned summary directory): only when the
  # error names a path in the workdir (not, say, an unreadable data file). It was a traceback,
  # exit 1 (a probe, 2026-12-07).
  in_workdir = _names_a_path_in(f"{text} {getattr(error, 'filename', '') or ''}", workdir)
  if not (full or (_no_permission(error) and in_workdir)):
    return None
  return (f"cannot write to `--workdir`={workdir} ({errors.describe_error(error)}); "
          f"{storage_hint(error)} The latest checkpoint is {latest_checkpoint(workdir) or 'none'}"
          ": fix that and rerun to resume")


def latest_checkpoint(workdir: str):
  """The latest checkpoint's prefix in `workdir` for an error line, or None (also when it
  cannot be read). Eager, host."""
  try:
    return tf.train.latest_checkpoint(checkpoint_dir(workdir))
  except (tf.errors.OpError, ValueError):
    return None


def _vanished(prefix: str) -> bool:
  """Whether checkpoint `prefix`, whose read failed, was deleted meanwhile (its index file gone;
  deletion removes the data file and the index one after the other)."""
  if not tf.io.gfile.exists(prefix + ".index"):
    return True
  time.sleep(_DELETE_GRACE_S)
  return not tf.io.gfile.exists(prefix + ".index")


def restore_newest_intact(checkpoint, directory: str, strategy, *, repair: bool):
  """Restores the newest checkpoint in `directory` that reads back whole; returns its prefix.

  Eager, host. Candidates are the `ckpt-N` files present, whatever the `checkpoint` state file
  says (it may be missing, garbage, or name a file that is gone). A damaged newer checkpoint is
  skipped with ONE warning line naming it and why. With `repair` (the chief), damaged files move
  to `directory/damaged/` and the state file is rewritten to list the intact ones, so that the
  Controller and later saves agree. Returns None when there is no checkpoint at all; raises
  `errors.ConfigError` when checkpoints exist but none reads back (nothing is overwritten), when
  one belongs to another config, or (`repair`) when the state file names a checkpoint but no
  `ckpt-N` is left: Orbit would fail restoring it, and a fresh start would hide the loss.
  """
  candidates, skipped = numbered(directory), []
  relists = 0
  while candidates:
    number, prefix = candidates.pop(0)
    damage = restore_one(checkpoint, prefix, strategy)
    if (damage and damage.startswith("NotFoundError") and relists < _RELISTS
        and _vanished(prefix)):
      # Deleted while read: a live trainer's CheckpointManager keeps only the newest few, and
      # a reader beside it (mode=eval) lost the race. Not damage: list again (found 2026-12-05).
      relists += 1
      tried = {p for p, _ in skipped} | {prefix}
      candidates = [(n, p) for n, p in numbered(directory) if p not in tried]
      continue
    if damage:
      skipped.append((prefix, damage))
      continue
    if skipped:
      logging.warning("skipped damaged checkpoint(s) %s; resuming from %s",
                      "; ".join(f"{p} ({why})" for p, why in skipped), prefix)
    if repair:
      try:
        _repair(directory, [p for p, _ in skipped],
                [p for n, p in numbered(directory) if n <= number])
      except STORAGE_ERRORS as e:
        raise CheckpointWriteError(
            f"cannot set the damaged checkpoint(s) aside in {directory} ({errors.describe_error(e)}); "
            "read-only or full? Nothing was lost: make it writable and rerun") from None
    return prefix
  if skipped:
    raise errors.ConfigError(
        f"no checkpoint in {directory} reads back ({'; '.join(why for _, why in skipped[:2])}); "
        "nothing was overwritten: move them away or use a fresh `--workdir` to start over")
  named = _named_by_state_file(directory) if repair else None
  if named:  # A run was here (TF writes the state file after a save's files): all deleted?
    raise errors.ConfigError(
        f"{directory}/checkpoint names {named}, but no ckpt-N file is left in {directory}; "
        "nothing was overwritten: put the checkpoints back, or delete that state file (or use "
        "a fresh `--workdir`) to start over")
  return None


def _state_file(directory: str):
  """The `checkpoint` state file's CheckpointState, or None (missing or unreadable: it names
  nothing usable)."""
  try:
    return tf.train.get_checkpoint_state(directory)
  except (tf.errors.OpError, ValueError):
    return None


def _named_by_state_file(directory: str):
  """The checkpoint name the `checkpoint` state file gives (e.g. ckpt-12), or None."""
  state = _state_file(directory)
  path = None if state is None else state.model_checkpoint_path
  return os.path.basename(path) if path else None


def restore_one(checkpoint, prefix: str, strategy):
  """Restores the checkpoint `prefix`; returns None, or why it is damaged (then the restore
  may have read part of it: restore another). Eager, host. Raises CheckpointReadError when the
  storage failed, `errors.ConfigError` when it belongs to another config."""
  status = None
  try:
    with strategy.scope():
      status = checkpoint.restore(prefix)
      status.assert_existing_objects_matched()
      # Every object found its value; a value no object takes (the constant learning rate's
      # variable of checkpoints written before 2026-12-07) is no cause for TF's warnings.
      status.expect_partial()
  except _DAMAGE as e:
    return errors.describe_error(e)
  except tf.errors.OpError as e:
    if type(e) is not tf.errors.OpError:  # Bare OpError: the reader's checksum mismatch.
      raise CheckpointReadError(
          f"cannot read the checkpoint {prefix} ({errors.describe_error(e)}); storage unavailable? "
          "Nothing was moved; rerun to resume") from None
    return errors.describe_error(e)
  except (AssertionError, ValueError) as e:
    if status is not None:  # Else TF warns about the unmatched values at exit, after our line.
      status.expect_partial()
    if _vanished(prefix):  # Deleted halfway through the read, not another model's.
      return f"NotFoundError: {prefix} was deleted while read"
    raise errors.ConfigError(
        f"the checkpoint {prefix} does not match this config (model, optimizer or "
        f"mixed_precision changed?); use a fresh `--workdir` ({type(e).__name__})") from None
  return None


NO_CHECKPOINT = -1


def newest_number(directory: str) -> int:
  """The update number of the newest `ckpt-N` index file in `directory`; NO_CHECKPOINT (-1)
  when none (a lone `ckpt-0`, e.g. from `train_steps=0`, is 0, which must differ from none)."""
  found = numbered(directory)
  return found[0][0] if found else NO_CHECKPOINT


def _mean_over_workers(strategy, values: list):
  """The mean of `values` (float64) over every replica of every worker, the same on each
  (eager; one collective, which every worker must call at the same point)."""
  value = tf.constant(values, tf.float64)
  mean = tf.function(lambda: strategy.reduce(
      tf.distribute.ReduceOp.MEAN, strategy.run(lambda: value), axis=None), autograph=False)
  return mean().numpy()


def workers_agree(strategy, number: int) -> bool:
  """Whether every worker holds the same integer `number` (eager; one collective on all, which
  every worker must call at the same point). True off MultiWorkerMirrored."""
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return True
  moments = _mean_over_workers(strategy, [float(number), float(number) ** 2])
  return moments[1] - moments[0] ** 2 <= 0.1  # Integers: a disagreement gives >= 0.25.


def chief_says(strategy, flag: bool, chief: bool) -> bool:
  """The chief's `flag` on every worker (eager; one collective under MultiWorkerMirrored, which
  every worker must call at the same point; the other workers' flags are not read)."""
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return flag
  return float(_mean_over_workers(strategy, [1.0 if flag and chief else 0.0])[0]) > 0


def check_workers_agree(strategy, number: int, what: str) -> None:
  """Multi-worker: every worker must hold the same `number` (eager, one collective on all).

  `what` names it in the error: e.g. the newest checkpoint each worker sees (checked BEFORE any
  restore: under MultiWorkerMirroredStrategy a restore broadcasts from worker 0, so a worker that
  has no checkpoint to restore would leave the others' collectives unmatched and crash), or the
  update each restored (checked after: a file seen damaged by one worker and not another would
  otherwise put them out of step without any error). Raises `errors.ConfigError`.
  """
  if not workers_agree(strategy, number):
    shown = "none" if number == NO_CHECKPOINT else str(int(number))
    raise errors.ConfigError(
        f"the workers disagree on {what} (this one: {shown}; another worker has a different "
        "one); give every worker the same workdir files and restart them together")


def _repair(directory: str, damaged: list, intact_newest_first: list) -> None:
  """Moves damaged checkpoints aside and points the state file at the intact ones."""
  if damaged:
    aside = os.path.join(directory, "damaged")
    tf.io.gfile.makedirs(aside)
    for prefix in damaged:
      name = _unused(aside, os.path.basename(prefix))
      for path in tf.io.gfile.glob(prefix + ".*"):
        tf.io.gfile.rename(path, os.path.join(aside, name + path[len(prefix):]))
  intact = list(reversed(intact_newest_first))  # Oldest first, as the state file lists them.
  names = [os.path.basename(p) for p in intact]
  state = _state_file(directory)
  listed = [] if state is None else list(state.all_model_checkpoint_paths)
  if (damaged or state is None or state.model_checkpoint_path != os.path.join(directory, names[-1])
      or listed != [os.path.join(directory, name) for name in names]):
    logging.warning("rewrote %s/checkpoint to list %s", directory, ", ".join(names))
    # With their times, and an older last-preserved time: without them TensorFlow's
    # CheckpointManager keeps the listed checkpoints forever and leaves them out of its own
    # list, so `keep_checkpoints` stopped working and every later resume rewrote the file.
    # Not later than now: TensorFlow clamps a future time to now, equal to the last-preserved
    # time it clamps alike, and keeps such a checkpoint forever (files copied from a machine
    # whose clock ran ahead: 6 kept with keep 3, a probe, 2026-12-07).
    latest = time.time() - 1.0
    stamps = [min(tf.io.gfile.stat(p + ".index").mtime_nsec / 1e9, latest) for p in intact]
    # Bare names, as the manager writes them (TF reads them relative to the directory). With
    # absolute paths a workdir moved later named its old place: a traceback (NotFoundError), or
    # a copy that resumed from, and pruned, the original's checkpoints (a probe, 2026-12-07).
    # Only the listed paths are compared above, so such a file is rewritten too.
    checkpoint_management.update_checkpoint_state_internal(
        directory, names[-1], all_model_checkpoint_paths=names, save_relative_paths=True,
        all_model_checkpoint_timestamps=stamps, last_preserved_timestamp=min(stamps) - 1.0)


def _unused(directory: str, name: str) -> str:
  """`name` (e.g. ckpt-6), or `name_1`, `name_2`, ...: the first checkpoint prefix with no
  files in `directory` (damaged copies are kept, each still loadable as a prefix)."""
  candidate, n = name, 0
  while tf.io.gfile.glob(os.path.join(directory, candidate + ".*")):
    n += 1
    candidate = f"{name}_{n}"
  return candidate
