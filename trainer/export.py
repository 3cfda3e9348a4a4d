"""Export: the trained model as a SavedModel with a serving signature. Eager, host, chief only.

    workdir/export/<update>/     `tf.saved_model.load(path).serve(inputs)` -> the model's outputs

Written with Keras 3's `model.export(format="tf_saved_model")`, which saves the model's forward
pass in inference mode (`training=False`) as the `serve` endpoint and `serving_default`
signature. The input signature is the model's own `inputs`, or `Task.serving_signature()` for
models without them (subclassed models). The files are written to a temporary directory and
renamed into place, so `export/<update>` is either complete or absent. Local and gs:// workdirs
alike (`tf.io.gfile`; on GCS a directory rename copies, so it is not atomic there).

The temporary directory is `export/<update>.partial.<pid>` (as `workdir.write_atomically` names
its files): a `mode=export` beside a trainer
exporting the same update writes its own (with one shared name each deleted the other's files:
a NotFound traceback). Temporary directories of processes no longer alive on this host (killed
while exporting) are removed. An export of the same update that is already in place and
complete (`saved_model.pb`) is kept: it holds the same weights.
"""
import os

from absl import logging
import tensorflow as tf

from trainer import checkpointing
from trainer import errors


def _remove(path: str) -> None:
  if tf.io.gfile.exists(path):
    tf.io.gfile.rmtree(path)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Alive, another user's.
    pass
  return True


def _remove_stale_partials(final: str) -> None:
  """Removes `final`.partial (older microstep) and `final`.partial.<pid> of dead processes."""
  for path in tf.io.gfile.glob(final + ".partial*"):
    suffix = path[len(final + ".partial"):]
    if suffix == "" or (suffix.startswith(".") and suffix[1:].isdigit()
                        and not _alive(int(suffix[1:]))):
      _remove(path)


def _complete(path: str) -> bool:
  return tf.io.gfile.exists(os.path.join(path, "saved_model.pb"))


def export_model(task, model, workdir: str, step: int) -> str:
  """Writes `workdir/export/<step>` (local or gs://, through tf.io.gfile); returns its path."""
  final = os.path.join(workdir, "export", str(step))
  partial = f"{final}.partial.{os.getpid()}"
  signature = task.serving_signature()
  try:
    _remove_stale_partials(final)
    _remove(partial)
    tf.io.gfile.makedirs(os.path.dirname(final))
    model.export(partial, format="tf_saved_model", verbose=False, input_signature=signature)
  except (ValueError, TypeError) as e:
    _remove(partial)
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise errors.TaskError(
        f"cannot export the model of {type(task).__name__} ({first_line}); give the task a "
        "serving_signature() returning the input tf.TensorSpec list") from None
  except checkpointing.STORAGE_ERRORS as e:  # Disk full, read-only, permissions.
    try:
      _remove(partial)
    except checkpointing.STORAGE_ERRORS:
      pass
    raise checkpointing.CheckpointWriteError(
        f"cannot write the export {final} ({errors.describe_error(e)}); "
        f"{checkpointing.storage_hint(e)} The checkpoints are intact: fix that and rerun with "
        "`mode=export`") from None
  try:
    if _complete(final):  # Another process (or an earlier run) exported this update.
      _remove(partial)
    else:
      _remove(final)  # (A file or an incomplete directory in its place.)
      tf.io.gfile.rename(partial, final)
  except (*checkpointing.STORAGE_ERRORS, tf.errors.OpError) as e:  # (Also a lost race.)
    if _complete(final):  # Renamed there by the other process in between: same weights.
      _remove(partial)
      return final
    raise checkpointing.CheckpointWriteError(
        f"cannot move the complete export {partial} to {final} ({type(e).__name__}); move it "
        "by hand") from None
  logging.info("exported the model of update %d to %s", step, final)
  return final
