"""Which weights a training run evaluated last: `WORKDIR/evaluated.json`, so a resume at an
update whose evaluation is done does not evaluate the same weights a second time.

A run resumed exactly at a multiple of `eval_every` cannot tell from its checkpoint whether
the run before evaluated that update: a SIGTERM in the loop that reached it exits before the
evaluation, a SIGTERM during the evaluation saves after it. The chief of a training run writes
this file (atomically) once an evaluation's summaries are on disk: the update and a SHA-256 of
the model's weights. A resume evaluates first unless the file names its update AND the weights
it restored, bit for bit (a run retrained from update 0 into the same workdir has other weights
at that update). Anything unreadable means "not evaluated": the evaluation runs, as it did.

All of it is eager, on the host. Under MultiWorkerMirrored the chief decides and one collective
tells the other workers (they may not see the chief's files), since an evaluation is collective.
"""
import hashlib
import json
import os

from absl import logging
import numpy as np
import orbit
import tensorflow as tf

from trainer import checkpointing
from trainer import workdir as workdir_lib

FILE = "evaluated.json"


def weights_digest(model) -> str:
  """SHA-256 of the model's weights (trainable or not), in `model.weights` order. Not their
  names: Keras numbers layers per process (`dense_1` in a notebook's second run).

  Hashes each weight's buffer in place (`tobytes()` copied it first: 411 MB more host memory
  for VGG-16's largest kernel); VGG-16's 553 MB hash in ~0.45 s (docs/benchmarks.md)."""
  digest = hashlib.sha256()
  for weight in model.weights:
    value = np.asarray(weight.numpy())
    digest.update(f"{value.dtype.str}{value.shape}".encode())
    digest.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
  return digest.hexdigest()


def _record(workdir: str, update: int, model) -> None:
  workdir_lib.write_atomically(
      os.path.join(workdir, FILE),
      json.dumps({"update": update, "weights_sha256": weights_digest(model)}, indent=2))


def _read(workdir: str):
  try:
    with tf.io.gfile.GFile(os.path.join(workdir, FILE)) as f:
      return json.loads(f.read())
  except (tf.errors.OpError, OSError, ValueError):  # Absent, unreadable or cut short.
    return None


class RecordingSummaryManager(orbit.utils.SummaryManager):
  """Orbit's eval summary manager that records `FILE` once an evaluation's summaries are
  flushed (Orbit runs the eval actions before it writes the summaries, so an action would
  record an evaluation that a kill could still keep out of TensorBoard)."""

  def __init__(self, summary_dir: str, global_step, workdir: str, model):
    super().__init__(summary_dir, tf.summary.scalar, global_step=global_step)
    self._step, self._workdir, self._model = global_step, workdir, model

  def write_summaries(self, summary_dict) -> None:
    super().write_summaries(summary_dict)
    self.flush()
    _record(self._workdir, int(self._step.numpy()), self._model)


def already_evaluated(strategy, workdir: str, update: int, model, chief: bool) -> bool:
  """Whether the weights restored at `update` were evaluated by an earlier run (every worker
  calls it at the same point; one collective under MultiWorkerMirrored)."""
  known = _read(workdir) if chief else None
  done = (isinstance(known, dict) and known.get("update") == update
          and known.get("weights_sha256") == weights_digest(model))
  done = checkpointing.chief_says(strategy, done, chief)
  if done:
    logging.info("update %d was evaluated already, with these weights (%s): not again",
                 update, os.path.join(workdir, FILE))
  return done
