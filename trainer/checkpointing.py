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
import os

from absl import logging
import tensorflow as tf


class _ManagerWithDataState(tf.train.CheckpointManager):
  """A CheckpointManager that saves a worker's iterator checkpoint after each main save."""

  def __init__(self, *args, data_manager=None, **kwargs):
    super().__init__(*args, **kwargs)
    self._data_manager = data_manager

  def save(self, checkpoint_number=None, check_interval=True, options=None):
    path = super().save(checkpoint_number=checkpoint_number, check_interval=check_interval,
                        options=options)
    if path and self._data_manager is not None:
      self._data_manager.save(checkpoint_number=int(path.rsplit("-", 1)[1]), options=options)
    return path


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(workdir, "checkpoints")


def data_state_dir(workdir: str, worker_id: int) -> str:
  return os.path.join(workdir, "data_state", f"worker_{worker_id}")


def create_manager(checkpoint, workdir: str, *, is_chief: bool, worker_id: int, step_counter,
                   config, data_iterator=None) -> tf.train.CheckpointManager:
  """The run's checkpoint manager (the chief's directory, or a worker's scratch directory).

  With `data_iterator`, each save also stores this worker's iterator under `data_state/`.
  """
  own_dir = checkpoint_dir(workdir) if is_chief else os.path.join(workdir,
                                                                  f"tmp_worker_{worker_id}")
  if not is_chief and tf.io.gfile.exists(own_dir):
    tf.io.gfile.rmtree(own_dir)  # Non-chief copies are scratch: always restore from the chief's.
  data_manager = None
  if data_iterator is not None:
    data_manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(iterator=data_iterator), data_state_dir(workdir, worker_id),
        max_to_keep=config.keep_checkpoints + 1)
  return _ManagerWithDataState(
      checkpoint, own_dir, max_to_keep=config.keep_checkpoints if is_chief else 1,
      step_counter=step_counter, checkpoint_interval=config.checkpoint_every,
      data_manager=data_manager)


def restore_data_state(data_iterator, workdir: str, worker_id: int, step: int) -> bool:
  """Restores this worker's iterator saved at update `step`; False if there is none."""
  path = os.path.join(data_state_dir(workdir, worker_id), f"ckpt-{step}")
  if not tf.io.gfile.exists(path + ".index"):
    return False
  tf.train.Checkpoint(iterator=data_iterator).restore(path).assert_existing_objects_matched()
  logging.info("restored the input iterator of update %d from %s", step, path)
  return True
