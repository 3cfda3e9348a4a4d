"""Export: the trained model as a SavedModel with a serving signature. Eager, host, chief only.

    workdir/export/<update>/     `tf.saved_model.load(path).serve(inputs)` -> the model's outputs

Written with Keras 3's `model.export(format="tf_saved_model")`, which saves the model's forward
pass in inference mode (`training=False`) as the `serve` endpoint and `serving_default`
signature. The input signature is `Task.serving_signature()` if the task gives one, else the
model's own `inputs` (functional and Sequential models). A subclassed model has no `inputs`,
and Keras would guess float32 for every input it saw (a string field, a dict's names: lost,
and an export that cannot serve); its signature is instead read from how the task calls it:
the task's loss is traced on the training data's specs, and the structure passed to the model,
less the dict fields the model does not read, becomes the signature (named after the fields).
The files are written to a temporary directory and
renamed into place, so `export/<update>` is either complete or absent. Local and gs:// workdirs
alike (`tf.io.gfile`; on GCS a directory rename copies, so it is not atomic there).

The temporary directory is `export/<update>.partial.<pid>` (as `workdir.write_atomically` names
its files): a `mode=export` beside a trainer
exporting the same update writes its own (with one shared name each deleted the other's files:
a NotFound traceback). Temporary directories of processes no longer alive on this host (killed
while exporting) are removed. An export of the same update that is already in place and
complete (`saved_model.pb`) is kept when its variables equal the new one's (the other
process's copy); if they differ, it is an earlier run's (one trained again from update 0) and
is renamed `export/<update>.replaced.<time>.<pid>` before the new one takes its place.
"""
import os
import time
from typing import Optional
from unittest import mock

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from trainer import base_task
from trainer import checkpointing
from trainer import data
from trainer import errors
from trainer import sources


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


def check_exportable(model) -> None:
  """Eager, host, before training: raises TaskError for a model that Keras cannot export, so that
  a run that exports at its end fails at its start. A model named with a leading `_` (Keras
  names a subclassed model after its class: `_Net` -> `__net`) fails `model.export`, in or out
  of a name scope: TensorFlow refuses it as a root scope name."""
  if model.name.startswith("_"):
    raise errors.TaskError(
        f"the model's name {model.name!r} starts with '_', which Keras cannot export (TensorFlow "
        "refuses it as a root name scope; Keras names a subclassed model after its class); give "
        "the model a name, e.g. super().__init__(name='my_net'), or set `export_at_end`=False")


def _variable_values(export_dir: str) -> list:
  """The values of a SavedModel's variables, sorted, without their names: the same model
  exported twice lists its variables in another order (at the end of training, then by
  `mode=export`). Eager, host; reads them all."""
  reader = tf.train.load_checkpoint(os.path.join(export_dir, "variables", "variables"))
  values = (np.asarray(reader.get_tensor(name))
            for name in reader.get_variable_to_shape_map() if name.endswith("VARIABLE_VALUE"))
  return sorted((str(v.dtype), v.shape, repr(v.tolist()) if v.dtype == object else v.tobytes())
                for v in values)


def _same_weights(export_a: str, export_b: str) -> Optional[bool]:
  """Whether two SavedModels hold the same variable values, bitwise; None when one cannot be
  read (still being copied into place by another process, on gs://, where a directory rename
  copies file by file): such an export is taken as the other process's, never set aside."""
  try:
    return _variable_values(export_a) == _variable_values(export_b)
  except tf.errors.OpError:
    return None


def batch_spec(source, batch_size: int) -> dict:
  """TensorSpecs of a training batch of `source` (host; builds the pipeline, reads nothing)."""
  context = tf.distribute.InputContext()
  if isinstance(source, sources.DatasetFactory):
    return data.factory_train_stream(context, source, batch_size, for_specs=True).element_spec
  return data.train_stream(context, source, batch_size, seed=0, shuffle=False).element_spec


def _read_inputs(model, spec):
  """`spec` less the fields of a top-level dict that the model's graph never reads (labels,
  weights: tasks often pass the whole batch); leaves are named after their fields."""
  if not isinstance(spec, dict) or not all(isinstance(v, tf.TensorSpec) for v in spec.values()):
    return spec
  spec = {name: tf.TensorSpec(v.shape, v.dtype, name=name) for name, v in spec.items()}
  graph = tf.function(lambda inputs: model(inputs, training=False),
                      input_signature=[spec], autograph=False).get_concrete_function().graph
  placeholders = dict(zip(sorted(spec), graph.inputs))  # tf.nest orders a dict by key.
  return {name: v for name, v in spec.items() if placeholders[name].consumers()} or spec


def recorded_signature(task, model, signature_sources, batch_size: int) -> Optional[list]:
  """The input signature of a subclassed model, from the inputs the task passes to it.

  Eager, host (traces the task's loss once per source tried; runs nothing). The sources are
  tried in order until the loss traces on one's batch specs. One spec structure per positional
  argument of the task's first call of the model, as Keras orders a signature; an argument that
  is a batch field as it is takes the field's name. None for
  functional and Sequential models (Keras knows their inputs), and, with a warning, when the
  task's calls cannot be read (Keras then infers float32 inputs).
  """
  if isinstance(model, keras.Sequential) or getattr(model, "_inputs_struct", None) is not None:
    return None
  seen = []
  call = type(model).__call__

  def recording_call(self, *args, **kwargs):
    if self is model and not seen:
      seen.append(args)
    return call(self, *args, **kwargs)
  fields = {}  # A batch field passed to the model as it is names its input (not `args_0`).

  def loss(batch):
    if isinstance(batch, dict):
      fields.update({t.ref(): name for name, t in batch.items() if isinstance(t, tf.Tensor)})
    return base_task.weighted_outputs(task, model, batch, False)
  failures = []
  for source in signature_sources:
    try:
      trace = tf.function(loss, input_signature=[batch_spec(source, batch_size)],
                          autograph=False)
      with mock.patch.object(type(model), "__call__", recording_call):
        trace.get_concrete_function()
      break
    except Exception as e:  # pylint: disable=broad-except  (The run itself traced this fine.)
      failures.append(errors.describe_error(e))
      seen.clear()
  if failures and not seen:
    logging.warning("export: could not trace %s's loss outside the run (%s)", type(task).__name__,
                    "; ".join(failures))
  args = seen[0] if seen else ()
  if not args or not all(isinstance(t, tf.Tensor) for t in tf.nest.flatten(args)):
    logging.warning("export: the inputs of subclassed model %s are Keras' guess (float32); if "
                    "it takes other dtypes or a dict, give %s a serving_signature()",
                    type(model).__name__, type(task).__name__)
    return None
  spec = tf.nest.map_structure(
      lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype, name=fields.get(t.ref())), args)
  return [_read_inputs(model, spec[0])] if len(spec) == 1 else list(spec)


def export_model(task, model, workdir: str, step: int, signature_sources=(),
                 batch_size: int = 1) -> str:
  """Writes `workdir/export/<step>` (local or gs://, through tf.io.gfile); returns its path,
  absolute for a local workdir (it goes into result.json, read from anywhere).

  The input signature is `task.serving_signature()`, else the one recorded from the task's
  calls on the first of `signature_sources` whose batches it traces (subclassed models), else
  the model's own inputs.
  """
  local = "://" not in workdir
  final = os.path.join(os.path.abspath(workdir) if local else workdir, "export", str(step))
  partial = f"{final}.partial.{os.getpid()}"
  signature = task.serving_signature()
  try:
    if signature is None and signature_sources:
      signature = recorded_signature(task, model, signature_sources, batch_size)
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
    complete = _complete(final)
    if complete and _same_weights(final, partial) is not False:  # Another process's copy.
      _remove(partial)
    else:
      if complete:  # Of another run at this update (one trained again from 0).
        aside = f"{final}.replaced.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}"
        tf.io.gfile.rename(final, aside)
        logging.warning("%s held another model (an earlier run's); set it aside as %s",
                        final, aside)
      _remove(final)  # (A file or an incomplete directory in its place.)
      tf.io.gfile.rename(partial, final)
  except (*checkpointing.STORAGE_ERRORS, tf.errors.OpError) as e:  # (Also a lost race.)
    if _complete(final) and _same_weights(final, partial) is not False:  # Renamed there by
      _remove(partial)                                  # another process in between.
      return final
    raise checkpointing.CheckpointWriteError(
        f"cannot move the complete export {partial} to {final} ({type(e).__name__}); move it "
        "by hand") from None
  logging.info("exported the model of update %d to %s", step, final)
  return final
