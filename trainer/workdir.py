"""The workdir: who may write it, and whether a restart may reuse what it holds. Eager, host.

* `check_writable` refuses a workdir that cannot hold a run (not writable, `checkpoints` a file).
* `Lock`: one live run per workdir and process. An exclusive `flock` on `.lock` (one process)
  or `.lock.<task>_<index>` (each multi-worker task); the file records host, PID and start time for the message a second run
  prints. The kernel drops the lock when its process dies, even by kill -9, so a lock left by a
  killed run is simply taken over. Workers of one MultiWorkerMirrored run lock different files
  and share the workdir as before. gs:// workdirs are not locked (no flock there).
* `check_resume`: the resolved config of the run lives in `config.json`. A restart that changes
  a field which gives the saved state its meaning (batch size, seed, task, model, optimizer,
  accumulation, data) is refused, naming the fields and the override that accepts them.
"""
import datetime
import fcntl
import json
import os
import socket

from absl import logging
import tensorflow as tf

from trainer import errors

# Fields whose change reinterprets a checkpoint: the data position (`micro_batches_seen`) counts
# micro-batches of `batch_size` examples in an order fixed by `seed`, the data's size and
# identity and the task; the optimizer's slots belong to its name; an update is k micro-steps of
# `accumulation`. (Moving the same files, `data.dir`, stays free.)
RESUME_FIXED = ("task", "model", "batch_size", "seed", "mixed_precision", "optimizer.name",
                "accumulation.steps", "accumulation.mode", "data.source", "data.path",
                "data.shuffle", "data.name", "data.image_size", "data.synthetic_train_examples",
                "data.features_key", "data.labels_key", "text.vocab_size",
                "text.sequence_length", "text.target_token", "text.train_examples",
                "histogram.features", "histogram.train_examples")


def _field(config, dotted: str):
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return None
    node = node[part]
  return node


def check_writable(workdir: str) -> None:
  """Raises ConfigError unless `workdir` can hold a run (creates it)."""
  if workdir.startswith("gs://"):
    return
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write_probe.{os.getpid()}")  # Workers may share workdir.
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise errors.ConfigError(f"`--workdir`={workdir!r} is not writable: {e.strerror}") from None
  for name in ("checkpoints", "export", "summaries"):
    path = os.path.join(workdir, name)
    if os.path.exists(path) and not os.path.isdir(path):
      raise errors.ConfigError(f"`--workdir`={workdir!r} holds a file named {name!r} where the "
                               "run keeps a directory; move it away or use another workdir")


class Lock:
  """`with Lock(workdir, task):` one live run per workdir and task (see the module docstring).

  `task`: "" for a single process, else the multi-worker task, e.g. "worker_1".
  """

  def __init__(self, workdir: str, task: str = ""):
    name = f".lock.{task}" if task else ".lock"
    self.path = None if workdir.startswith("gs://") else os.path.join(workdir, name)
    self._file = None

  def __enter__(self):
    if self.path is None:
      return self
    handle = open(self.path, "a+")  # pylint: disable=consider-using-with
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      handle.seek(0)
      holder = handle.read().strip() or "another process"
      handle.close()
      raise errors.ConfigError(
          f"`--workdir`={os.path.dirname(self.path)!r} is in use by a live run ({holder}); wait "
          "for it, stop it, or use another workdir") from None
    handle.seek(0)
    previous = handle.read().strip()
    if previous:
      logging.info("took over the workdir lock of a run that is gone (%s)", previous)
    handle.seek(0)
    handle.truncate()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n")
    handle.flush()
    self._file = handle
    return self

  def __exit__(self, *exc):
    if self._file is not None:
      self._file.seek(0)
      self._file.truncate()
      self._file.close()  # Closing releases the flock.
      self._file = None


def check_resume(config, workdir: str) -> None:
  """Refuses a restart whose config changes a field in RESUME_FIXED (unless allowed)."""
  path = os.path.join(workdir, "config.json")
  if not tf.io.gfile.exists(path):
    logging.warning("resuming without %s: cannot check that the config is unchanged", path)
    return
  try:
    with tf.io.gfile.GFile(path) as f:
      saved = json.load(f)
  except ValueError:
    logging.warning("resuming with an unreadable %s: cannot check the config", path)
    return
  allowed = {a.strip() for a in str(config.allow_config_change).split(",") if a.strip()}
  changed = []
  for field in RESUME_FIXED:
    node = saved
    for part in field.split("."):
      node = node.get(part) if isinstance(node, dict) else None
    now = _field(config, field)
    if node is not None and now is not None and node != now and field not in allowed:
      changed.append((field, node, now))
  if changed:
    what = ", ".join(f"`{f}` ({old!r} -> {new!r})" for f, old, new in changed)
    names = ",".join(f for f, _, _ in changed)
    raise errors.ConfigError(
        f"resuming `--workdir`={workdir!r} with a changed {what}: the saved state means "
        f"something else under it; use a fresh workdir, or accept with "
        f"--config.allow_config_change={names}")
