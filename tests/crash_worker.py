"""`python -m trainer.main` that dies (SIGKILL) or fails inside a chosen checkpoint save.

usage: python tests/crash_worker.py PHASE:STEP [trainer.main flags...]
PHASE: before_write (nothing written), mid_write (a timer kills while files are written),
after_files (files written, `checkpoint` index not yet updated), data_state (the main checkpoint
complete, the input iterator's not yet written), disk_full (writing the files fails with
ResourceExhaustedError, as on a full disk, after TF's scratch directory `ckpt-N_temp` got a
file), dir_gone (the checkpoint directory is deleted while the save writes: NotFoundError),
summary_disk_full (STEP ignored: creating a TensorBoard event file fails as on a full disk).
STEP: the global step whose save dies. Production code is untouched; the patches live only in
this process.
"""
import os
import random
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _die():
  os.kill(os.getpid(), signal.SIGKILL)


def main():
  phase, step = sys.argv[1].split(":")
  step = int(step)
  del sys.argv[1]
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.checkpoint import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  from tensorflow.python.checkpoint import checkpoint_management  # pylint: disable=g-import-not-at-top
  original_write = checkpoint_lib.Checkpoint._write  # pylint: disable=protected-access
  original_state = checkpoint_management.update_checkpoint_state_internal

  def write(self, file_prefix, options=None):
    if file_prefix.endswith(f"ckpt-{step}"):
      data_state = "data_state" in file_prefix
      if phase == "disk_full" and not data_state:
        scratch = file_prefix + "_temp"  # What TF's sharded save has written when it fails.
        tf.io.gfile.makedirs(scratch)
        with tf.io.gfile.GFile(scratch + "/part-00000-of-00001.data-00000-of-00001", "w") as f:
          f.write("x" * 1000)
        raise tf.errors.ResourceExhaustedError(
            None, None, f"{scratch}/part-00000-of-00001.data; No space left on device")
      if phase == "dir_gone" and not data_state:
        tf.io.gfile.rmtree(os.path.dirname(file_prefix))
        raise tf.errors.NotFoundError(None, None,
                                      f"{file_prefix}_temp; No such file or directory")
      if phase == "before_write" and not data_state or phase == "data_state" and data_state:
        _die()
      if phase == "mid_write" and not data_state:
        threading.Timer(random.uniform(0.0, 0.02), _die).start()
    return original_write(self, file_prefix, options=options)

  def update_state(save_dir, model_checkpoint_path, *args, **kwargs):
    if (phase == "after_files" and "data_state" not in save_dir
        and model_checkpoint_path.endswith(f"ckpt-{step}")):
      _die()
    return original_state(save_dir, model_checkpoint_path, *args, **kwargs)

  def full_disk_writer(logdir, *args, **kwargs):
    del args, kwargs
    raise tf.errors.ResourceExhaustedError(
        None, None, f"{logdir}/events.out.tfevents.1.host.1.v2; No space left on device\n"
        "\tFlushing first event.\n\tCould not initialize events writer.")

  if phase == "summary_disk_full":
    tf.summary.create_file_writer = full_disk_writer
  checkpoint_lib.Checkpoint._write = write  # pylint: disable=protected-access
  checkpoint_management.update_checkpoint_state_internal = update_state
  from trainer import main as trainer_main  # pylint: disable=g-import-not-at-top
  trainer_main.run_cli()


if __name__ == "__main__":
  main()
