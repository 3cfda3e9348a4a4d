"""The workdir: who may write it, and whether a restart may reuse what it holds. Eager, host.

* `check_writable` refuses a workdir that cannot hold a run (not writable, `checkpoints` a file).
* `Lock`: one live run per workdir and process. An exclusive `flock` on `.lock` (one process)
  or `.lock.<task>_<index>` (each multi-worker task); the file records host, PID and start time for the message a second run
  prints. The kernel drops the lock when its process dies, even by kill -9, so a lock left by a
  killed run is simply taken over. Workers of one MultiWorkerMirrored run lock different files
  and share the workdir as before. gs:// workdirs are not locked (no flock there).
* `note_training_start` warns when a run starts from 0 beside an earlier run's results, or past
  `train_steps`.
* `check_resume`: the resolved config of the run lives in `config.json`. A restart that changes
  a field which gives the saved state its meaning (batch size, seed, task, model, optimizer,
  accumulation, data; SGD momentum to or from 0, which adds or drops the optimizer's slots) is
  refused, naming the fields and the override that accepts them (an evaluation or export, which
  only reads the checkpoints, may change those of the training stream: batch size, seed, k); so is
  a restart over checkpoints whose `config.json` is missing or unreadable (written atomically,
  so only outside hands damage it), unless `allow_config_change` lists `unchecked`.
"""
import datetime
import fcntl
import json
import os
import re
import socket

from absl import logging
import tensorflow as tf

from trainer import checkpointing
from trainer import errors
from trainer import validation

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


# Of those, the ones that only give the training stream its meaning (which examples make each
# update): a run that only reads checkpoints (`eval`, `continuous_eval`, `export`) ignores them.
TRAINING_STREAM = ("batch_size", "seed", "accumulation.steps", "data.shuffle",
                   "data.synthetic_train_examples", "text.train_examples",
                   "histogram.train_examples")


# Fields every config.json microstep ever wrote holds: one without them says nothing.
RESUME_CORE = ("task", "model", "batch_size", "seed", "optimizer.name", "accumulation.steps")
# `allow_config_change` value that resumes a workdir whose config.json is missing or unreadable.
UNCHECKED = "unchecked"


def write_atomically(path: str, text: str) -> None:
  """Writes `text` to `path` so that a kill at any moment leaves the old file or the new one."""
  partial = f"{path}.partial.{os.getpid()}"
  try:
    with tf.io.gfile.GFile(partial, "w") as f:
      f.write(text)
    tf.io.gfile.rename(partial, path, overwrite=True)
  except (tf.errors.OpError, OSError):  # E.g. a full disk: leave no partial file behind.
    if tf.io.gfile.exists(partial):
      tf.io.gfile.remove(partial)
    raise


def _field(config, dotted: str):
  """A dotted field of a ConfigDict, or of the dict read from config.json; None if absent."""
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return None
    node = node[part]
  return node


# (path in the workdir, whether the run keeps a directory there) checked before a run starts.
_LAYOUT = (("checkpoints", True), ("export", True), ("summaries", True),
           (os.path.join("summaries", "train"), True), (os.path.join("summaries", "eval"), True),
           (os.path.join("checkpoints", "damaged"), True),
           (os.path.join("checkpoints", "checkpoint"), False), ("config.json", False),
           ("data_state", True), ("evaluated.json", False), ("result.json", False),
           ("result.eval.json", False), ("result.continuous_eval.json", False),
           ("result.export.json", False))


def check_name(workdir: str) -> None:
  """Raises ConfigError for a path TensorFlow's file system cannot take: one that is not
  UTF-8 (Python holds its bytes as surrogates; TF failed in `as_bytes` with a traceback), or
  one with a glob character. TensorFlow finds checkpoint files by glob (its CheckpointManager,
  `tf.train.latest_checkpoint`), so in `sweep[lr=0.1]` a run saw none of its own checkpoints and
  restarted from update 0, and in `run?` it restored a sibling `runA`'s (a probe, 2026-12-07).
  A URL other than gs:// (s3://, file://, hdfs://) is refused too: the workdir lock is a local
  file, which went to ./s3:/... while TensorFlow wrote elsewhere or failed."""
  try:
    workdir.encode("utf-8")
  except UnicodeEncodeError:
    raise errors.ConfigError(
        f"`--workdir`={workdir!r} is not valid UTF-8, which TensorFlow's file system needs; "
        "name a directory whose path is UTF-8") from None
  scheme = re.match(r"^([A-Za-z][A-Za-z0-9.]*)://", workdir)  # (A scheme as TF parses one.)
  if scheme and scheme.group(1) != "gs":  # The lock (a local flock) would go to ./s3:/...
    hint = (f"; for a local directory give its path: {workdir[len('file://'):]!r}"
            if scheme.group(1) == "file" else "")
    raise errors.ConfigError(
        f"`--workdir`={workdir!r} is a URL that microstep does not take; allowed: a local path "
        f"or gs://BUCKET/PATH{hint}")
  found = sorted(set(workdir) & set(_GLOB_CHARACTERS))
  if found:
    raise errors.ConfigError(
        f"`--workdir`={workdir!r} holds {' '.join(found)}, which TensorFlow reads as a glob "
        "pattern when it looks for checkpoints (a run would not find its own, or would take "
        f"another directory's); name it without any of {' '.join(_GLOB_CHARACTERS)}")


_GLOB_CHARACTERS = "*?[]\\"  # (A backslash escapes in TF's glob.)


def check_writable(workdir: str) -> None:
  """Raises ConfigError unless `workdir` can hold a run (creates it)."""
  if workdir.startswith("gs://"):
    return
  if os.path.exists(workdir) and not os.path.isdir(workdir):  # Was "is not writable: File exists".
    raise errors.ConfigError(f"`--workdir`={workdir!r} is a file, not a directory; name a "
                             "directory (it is made if missing)")
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write_probe.{os.getpid()}")  # Workers may share workdir.
    try:
      with open(probe, "w") as f:
        f.write("ok")
    finally:
      if os.path.exists(probe):
        os.remove(probe)
  except OSError as e:
    raise errors.ConfigError(f"`--workdir`={workdir!r} is not writable: {e.strerror}") from None
  for name, directory in _LAYOUT:
    path = os.path.join(workdir, name)
    if os.path.islink(path) and not os.path.exists(path):  # Its first save failed as "gone".
      raise errors.ConfigError(
          f"`--workdir`={workdir!r}: {name} is a symbolic link to {os.readlink(path)!r}, which "
          "does not exist (a disk not mounted?); mount it, or remove the link to start over")
    if os.path.exists(path) and os.path.isdir(path) != directory:
      kind, wanted = ("a file", "a directory") if directory else ("a directory", "a file")
      raise errors.ConfigError(f"`--workdir`={workdir!r} holds {kind} named {name!r} where the "
                               f"run keeps {wanted}; move it away or use another workdir")


class Lock:
  """`with Lock(workdir, task):` one live run per workdir and task (see the module docstring).

  `task`: "" for a single process, else the multi-worker task, e.g. "worker_1", or the mode
  of a run that only reads checkpoints. `role` (e.g. "mode=eval") heads the line the lock file
  holds, which names the holder in a second run's refusal.
  """

  def __init__(self, workdir: str, task: str = "", role: str = ""):
    name = f".lock.{task}" if task else ".lock"
    self.path = None if workdir.startswith("gs://") else os.path.join(workdir, name)
    self._role = f"{role}, " if role else ""
    self._file = None

  def __enter__(self):
    if self.path is None:
      return self
    try:  # Whatever bytes a damaged lock file holds, it only names the holder.
      handle = open(self.path, "a+", errors="replace")  # pylint: disable=consider-using-with
    except OSError as e:
      raise errors.ConfigError(f"`--workdir`: cannot open its lock file {self.path} "
                               f"({e.strerror}); move it away") from None
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
    handle.write(f"{self._role}host {socket.gethostname()}, pid {os.getpid()}, "
                 f"started {started}\n")
    handle.flush()
    self._file = handle
    return self

  def check_held(self) -> None:
    """Raises CheckpointWriteError when the lock file this run holds is no longer at its path:
    the workdir was deleted or moved (or the lock file removed) while the run used it. Its
    later saves would go to a directory made anew, beside no config.json, and a second run
    could take the lock there. Eager, host; a stat, cheap enough for every loop."""
    if self._file is None:
      return
    held = os.fstat(self._file.fileno())
    try:
      now = os.stat(self.path)
      same = (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev)
    except OSError:
      same = False
    if not same:
      raise checkpointing.CheckpointWriteError(
          f"`--workdir`={os.path.dirname(self.path)!r} was deleted or moved while this run used "
          f"it (its lock file {os.path.basename(self.path)} is gone or another one); stopped "
          "without saving, so that the run does not go on in a directory made anew: put the "
          "workdir back and rerun to resume from its newest checkpoint")

  def __exit__(self, *exc):
    if self._file is not None:
      self._file.seek(0)
      self._file.truncate()
      self._file.close()  # Closing releases the flock.
      self._file = None


def _saved_config(path: str):
  """(config.json as a dict, None), or (None, why it says nothing: a phrase after "its PATH").
  Raises CheckpointReadError when the storage failed (not the file's fault; rerun later)."""
  try:
    with tf.io.gfile.GFile(path) as f:
      saved = json.load(f)
  except tf.errors.NotFoundError:
    return None, "is missing"
  except ValueError as e:
    return None, f"does not read back ({type(e).__name__})"
  except tf.errors.OpError as e:
    raise checkpointing.CheckpointReadError(
        f"cannot read {path} ({type(e).__name__}); storage unavailable? Nothing was changed; "
        "rerun to resume") from None
  if not isinstance(saved, dict):
    return None, "does not read back (ValueError)"  # (A JSON list or null: its old message.)
  return saved, None


def allowed_changes(config) -> set:
  """The fields `allow_config_change` names; a name the guard never checks is a ConfigError
  (a typo let nothing through, silently; a probe, 2026-12-07). Eager, at start."""
  allowed = {a.strip() for a in str(config.allow_config_change).split(",") if a.strip()}
  unknown = sorted(allowed - set(RESUME_FIXED) - {"optimizer.momentum", UNCHECKED})
  if unknown:
    raise errors.ConfigError(
        f"`allow_config_change`={config.allow_config_change!r}: {unknown[0]!r} is no field the "
        f"restart guard checks; allowed: {', '.join(RESUME_FIXED)}, optimizer.momentum, "
        f"{UNCHECKED}")
  return allowed


def _optimizer_state(name, momentum) -> set:
  """The kinds of slots an optimizer keeps beside the weights: what its checkpoints hold."""
  if name == "sgd":
    return {"momentum"} if momentum > 0 else set()
  return {"first and second moments"} if name in ("adam", "adamw") else set()


def _state_added(saved, config) -> list:
  """(field, old, new, what) of the changes whose new config keeps state that the checkpoint
  cannot hold: no restore can resume them, whatever `allow_config_change` says."""
  added = []
  old_momentum = _field(saved, "optimizer.momentum")  # (Absent from an old config.json.)
  old_slots = _optimizer_state(_field(saved, "optimizer.name"), config.optimizer.momentum
                               if old_momentum is None else old_momentum)
  new_slots = _optimizer_state(config.optimizer.name, config.optimizer.momentum)
  if not new_slots <= old_slots:
    field = ("optimizer.name" if _field(saved, "optimizer.name") != config.optimizer.name
             else "optimizer.momentum")
    added.append((field, _field(saved, field), _field(config, field),
                  f"{config.optimizer.name}'s {', '.join(sorted(new_slots - old_slots))}"))
  old_precision = _field(saved, "mixed_precision")
  if config.mixed_precision == "mixed_float16" and old_precision not in (None, "mixed_float16"):
    added.append(("mixed_precision", old_precision, "mixed_float16", "a loss scale"))
  return added


def check_resume(config, workdir: str) -> None:
  """Refuses a restart whose config changes a field in RESUME_FIXED (unless allowed), and one
  whose new config keeps state the checkpoints cannot hold (always)."""
  path = os.path.join(workdir, "config.json")
  allowed = allowed_changes(config)
  saved, problem = _saved_config(path)
  if problem is None:
    missing = [f for f in RESUME_CORE if _field(saved, f) is None]
    if missing:  # `{}`, or keys deleted by hand: the guard would pass anything.
      problem = f"does not read back (an object without {', '.join(f'`{f}`' for f in missing)})"
  if problem is not None:
    if UNCHECKED not in allowed:
      raise errors.ConfigError(
          f"resuming `--workdir`={workdir!r}: its {path} {problem}, so nothing says which config "
          "its checkpoints were trained with; restore the file, or resume unchecked with "
          f"--config.allow_config_change={UNCHECKED}")
    logging.warning("resuming with %s that %s: the config is not checked (allow_config_change"
                    "=%s)", path, problem, UNCHECKED)
    return
  changed, unchecked = [], []
  reading = config.mode not in validation.TRAINING_MODES
  for field in (f for f in RESUME_FIXED if not (reading and f in TRAINING_STREAM)):
    node = _field(saved, field)
    now = _field(config, field)
    if node is None and now is not None and field not in allowed:
      unchecked.append(field)  # (A field newer than the workdir's microstep, or deleted.)
    if node is not None and now is not None and node != now and field not in allowed:
      changed.append((field, node, now))
  old, new = _field(saved, "optimizer.momentum"), _field(config, "optimizer.momentum")
  if (_field(saved, "optimizer.name") == "sgd" == _field(config, "optimizer.name")
      and old is not None and new is not None and old > 0 and not new > 0
      and "optimizer.momentum" not in allowed):  # SGD's momentum slots would vanish. (Slots
    changed.append(("optimizer.momentum", old, new))  # that would appear: `_state_added`.)
  if unchecked:
    logging.warning("resuming: %s has no %s; those fields are not checked", path,
                    ", ".join(unchecked))
  added = _state_added(saved, config)  # (Reading modes restore the optimizer too.)
  if added:  # (Restoring would fail on the missing slots: "another model?", a dead end.)
    field, old, new, what = added[0]
    raise errors.ConfigError(
        f"resuming `--workdir`={workdir!r} with a changed `{field}` ({old!r} -> {new!r}): the "
        f"new config keeps {what}, which its checkpoints do not hold, so no run can resume "
        "from them; use a fresh workdir, or keep the old value")
  if changed:
    what = ", ".join(f"`{f}` ({old!r} -> {new!r})" for f, old, new in changed)
    names = ",".join(f for f, _, _ in changed)
    raise errors.ConfigError(
        f"resuming `--workdir`={workdir!r} with a changed {what}: the saved state means "
        f"something else under it; use a fresh workdir, or accept with "
        f"--config.allow_config_change={names}")
  old_batch = _field(saved, "batch_size")
  if not reading and old_batch is not None and old_batch != config.batch_size:  # (Allowed.)
    effect = ("the examples between the old position and the new are skipped"
              if config.batch_size > old_batch else "examples before the old position are seen "
              "again")
    logging.warning(  # (A probe found it silent, 2026-12-07.)
        "resuming with `batch_size` %s -> %s (allowed): the data position and `examples_seen` "
        "count micro-batches, so the run resumes at the same count of %s-example micro-batches; "
        "%s", old_batch, config.batch_size, config.batch_size, effect)


def note_training_start(workdir: str, restored, step: int, train_steps: int) -> None:
  """Warns where a training run's start is likely not what its operator meant (eager, host,
  the chief). Both were silent until a probe (2026-12-07): a workdir whose checkpoints are gone
  but whose results of an earlier run remain starts again from update 0; a checkpoint past
  `train_steps` trains nothing."""
  if restored is None:
    earlier = [name for name in ("result.json", "export")
               if os.path.exists(os.path.join(workdir, name))]
    events = os.path.join(workdir, "summaries", "train")
    if tf.io.gfile.glob(os.path.join(events, "events.out.tfevents.*")):  # (A checkpoint dir
      earlier.append("summaries/train")  # emptied, or a disk not mounted, was silent: a probe.)
    directory = checkpointing.checkpoint_dir(workdir)
    if earlier:
      link = (f" (a link to {os.path.realpath(directory)}: is its disk mounted?)"
              if os.path.islink(directory) else "")
      logging.warning("no checkpoint in %s%s, though %s hold(s) an earlier run's results: "
                      "training starts again from update 0", directory, link,
                      " and ".join(earlier))
  elif step > train_steps:
    logging.warning("the checkpoint is at update %d, past `train_steps`=%d: nothing to train "
                    "(raise train_steps to go on)", step, train_steps)


def trained_to(workdir: str):
  """`train_steps` of the training run that wrote `workdir/config.json` (an evaluator beside it
  waits for that run's last update), or None when it cannot be read. Eager, host."""
  try:
    saved, _ = _saved_config(os.path.join(workdir, "config.json"))
  except checkpointing.CheckpointReadError:
    return None
  steps = None if saved is None else _field(saved, "train_steps")
  return steps if isinstance(steps, int) else None

