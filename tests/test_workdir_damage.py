"""What readers and reruns meet in a workdir (found by a fault probe, 2026-12-03).

Before these fixes: `mode=eval`, `export` and `continuous_eval` crashed on a damaged newest
checkpoint (or silently read the older one a stale state file named); a rerun of a finished
`train_and_eval` replaced its evaluation in result.json with null; a damaged config.json
silently turned the resume guard off; a second damaged copy of a checkpoint replaced the first
in `damaged/`; a lock file holding odd bytes crashed the run. In-process through `run.run`.
"""
import json
import os
import shutil
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import helpers
from trainer import checkpointing
from trainer import errors
from trainer import run
from trainer import workdir as workdir_lib


def _config(**overrides):
  return helpers.tiny_config(**dict({"train_steps": 6, "steps_per_loop": 2,
                                     "checkpoint_every": 2, "mode": "train"}, **overrides))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir with ckpt-2, -4 and -6 of a finished run; copy it before damaging it."""
  workdir = tmp_path_factory.mktemp("trained")
  run.run(_config(), str(workdir))
  return workdir


def _copy(trained, tmp_path):
  shutil.copytree(trained, tmp_path / "w")
  return tmp_path / "w"


@pytest.mark.parametrize("mode", ["eval", "export", "continuous_eval"])
@pytest.mark.parametrize("how,update", [("data_truncated", 4), ("index_missing", 4),
                                        ("state_names_missing", 6), ("state_older", 6)])
def test_readers_use_the_newest_intact_checkpoint(trained, tmp_path, mode, how, update):
  """The update a training rerun would resume from, whatever the state file names; nothing in
  the checkpoint directory is written or moved."""
  workdir = _copy(trained, tmp_path)
  helpers.damage_checkpoint(workdir, how)
  before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  result = run.run(_config(mode=mode, eval_timeout_s=1), str(workdir))
  assert result["global_step"] == update
  if mode == "export":
    assert (workdir / "export" / str(update)).is_dir()
  else:
    assert result["eval"] is not None and np.isfinite(result["eval"]["loss"])
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before


def test_continuous_eval_of_a_finished_run_stops_after_the_last_checkpoint(trained, tmp_path,
                                                                          monkeypatch):
  """It evaluated ckpt-6 (train_steps=6), then waited `eval_timeout_s` (600 s by default) for a
  checkpoint that cannot come (found by a probe, 2026-12-07). It must not poll at all."""
  def poll(*args, **kwargs):
    raise AssertionError("continuous_eval waited for a new checkpoint after the last one")
  monkeypatch.setattr(tf.train, "checkpoints_iterator", poll)
  result = run.run(_config(mode="continuous_eval", eval_timeout_s=600), str(_copy(trained,
                                                                                 tmp_path)))
  assert result["global_step"] == 6 and np.isfinite(result["eval"]["loss"])


def test_continuous_eval_waits_for_a_trainer_resumed_with_more_updates(trained, tmp_path,
                                                                       monkeypatch):
  """The trainer's config.json says train_steps=8 (a resume raised it, a free change); an
  evaluator started with the old train_steps=6 must keep watching after ckpt-6 (review)."""
  workdir = _copy(trained, tmp_path)
  saved = json.loads((workdir / "config.json").read_text())
  saved["train_steps"] = 8
  (workdir / "config.json").write_text(json.dumps(saved))
  polls = []
  monkeypatch.setattr(tf.train, "checkpoints_iterator",
                      lambda *args, **kwargs: polls.append(kwargs) or iter(()))
  result = run.run(_config(mode="continuous_eval", eval_timeout_s=1), str(workdir))
  assert result["global_step"] == 6 and np.isfinite(result["eval"]["loss"])
  assert len(polls) == 1


def test_a_state_file_whose_checkpoints_are_all_gone_is_one_line(trained, tmp_path):
  """Every ckpt-N deleted, the `checkpoint` state file left: the rerun was TF's NotFoundError
  traceback from Orbit's restore (found by a probe, 2026-12-07). Nothing may be overwritten."""
  workdir = _copy(trained, tmp_path)
  for path in (workdir / "checkpoints").glob("ckpt-*"):
    path.unlink()
  state = (workdir / "checkpoints" / "checkpoint").read_bytes()
  with pytest.raises(errors.ConfigError, match=r"/checkpoints/checkpoint names ckpt-6, but no "
                     r"ckpt-N file is left in \S+; nothing was overwritten: put the checkpoints "
                     r"back, or delete that state file"):
    run.run(_config(train_steps=8), str(workdir))
  assert (workdir / "checkpoints" / "checkpoint").read_bytes() == state
  assert not list((workdir / "checkpoints").glob("ckpt-*"))


def test_starts_an_operator_may_not_mean_are_warned(trained, tmp_path, caplog):
  """Both were silent (a probe, 2026-12-07): every checkpoint deleted beside an earlier run's
  result.json (a fresh start from update 0), and train_steps below the restored update."""
  workdir = _copy(trained, tmp_path)
  with caplog.at_level("WARNING"):
    run.run(_config(train_steps=4), str(workdir))  # Restored at update 6.
  assert "the checkpoint is at update 6, past `train_steps`=4: nothing to train" in caplog.text
  caplog.clear()
  shutil.rmtree(workdir / "checkpoints")
  with caplog.at_level("WARNING"):
    assert run.run(_config(train_steps=2), str(workdir))["global_step"] == 2
  assert "though result.json and summaries/train hold(s) an earlier run's results: training " \
         "starts again from update 0" in caplog.text


def test_checkpoints_on_a_disk_not_mounted_are_not_a_silent_restart(trained, tmp_path, caplog):
  """`checkpoints` a link to another disk: with the disk not mounted (an empty mount point) a
  run mid-way (no result.json yet) restarted from update 0 without a word; with the mount point
  gone, it trained, then failed its first save as "deleted or moved" (a probe, 2026-12-07)."""
  workdir = _copy(trained, tmp_path)
  (workdir / "result.json").unlink()
  shutil.move(str(workdir / "checkpoints"), str(tmp_path / "other_disk"))
  (tmp_path / "mount_point").mkdir()
  (workdir / "checkpoints").symlink_to(tmp_path / "mount_point")
  with caplog.at_level("WARNING"):
    assert run.run(_config(train_steps=2), str(workdir))["global_step"] == 2
  assert (f"no checkpoint in {workdir}/checkpoints (a link to {tmp_path}/mount_point: is its "
          "disk mounted?), though summaries/train hold(s) an earlier run's results: training "
          "starts again from update 0") in caplog.text
  (workdir / "checkpoints").unlink()
  (workdir / "checkpoints").symlink_to(tmp_path / "absent")
  with pytest.raises(errors.ConfigError, match=(
      r"^`--workdir`='.*': checkpoints is a symbolic link to '.*absent', which does not exist "
      r"\(a disk not mounted\?\); mount it, or remove the link to start over$")):
    run.run(_config(train_steps=2), str(workdir))


def test_rerunning_a_finished_train_and_eval_keeps_its_evaluation(trained, tmp_path):
  """The rerun evaluates the final weights again (also what a restart after a SIGTERM during the
  final evaluation needs), instead of writing "eval": null over the result."""
  workdir = _copy(trained, tmp_path)
  first = run.run(_config(mode="eval"), str(workdir))["eval"]
  again = run.run(_config(mode="train_and_eval"), str(workdir))
  assert again["global_step"] == 6
  assert again["eval"]["loss"] == pytest.approx(first["loss"], rel=1e-6)
  saved = json.loads((workdir / "result.json").read_text())
  assert saved["eval"]["loss"] == pytest.approx(first["loss"], rel=1e-6)


@pytest.mark.parametrize("damage", ["truncated", "not_an_object", "missing", "empty_object",
                                    "no_seed"])
def test_an_unreadable_config_json_refuses_the_resume_unless_unchecked(trained, tmp_path,
                                                                       damage):
  workdir = _copy(trained, tmp_path)
  path = workdir / "config.json"
  if damage == "truncated":
    path.write_text(path.read_text()[:100])
  elif damage == "not_an_object":
    path.write_text("null")
  elif damage == "empty_object":  # `{}` said nothing and let any change through.
    path.write_text("{}")
  elif damage == "no_seed":  # A key deleted by hand: its change went unchecked.
    saved = json.loads(path.read_text())
    del saved["seed"]
    path.write_text(json.dumps(saved))
  else:
    path.unlink()
  changed = {"train_steps": 8, "seed": 7}
  with pytest.raises(errors.ConfigError, match="config.json (is missing|does not read back).*"
                                               "allow_config_change=unchecked"):
    run.run(_config(**changed), str(workdir))
  assert not path.exists() or "\"seed\": 7" not in path.read_text()
  result = run.run(_config(allow_config_change=workdir_lib.UNCHECKED, **changed), str(workdir))
  assert result["global_step"] == 8
  assert json.loads(path.read_text())["seed"] == 7  # Written whole again, atomically.
  assert not list(workdir.glob("config.json.partial*"))


@pytest.mark.parametrize("clock", ["same", "files_from_the_future"])
def test_keep_checkpoints_still_holds_after_the_state_file_is_rebuilt(trained, tmp_path, clock):
  """A rebuilt state file listed the checkpoints without their times: TensorFlow's manager then
  kept them forever, so checkpoints piled up past `keep_checkpoints` on every later resume (a
  probe, 2026-12-06: 7 with keep 3). Files stamped in the future (a copy from a machine whose
  clock ran ahead) did the same: TF clamps such times to now, which equals its last-preserved
  time, so it kept them all (a probe, 2026-12-07: 6 with keep 3)."""
  workdir = _copy(trained, tmp_path)
  (workdir / "checkpoints" / "checkpoint").unlink()  # Rebuilt from the intact ckpt-2, -4, -6.
  if clock == "files_from_the_future":
    ahead = time.time() + 3600.0
    for path in (workdir / "checkpoints").glob("ckpt-*"):
      os.utime(path, (ahead, ahead))
  for train_steps, kept in ((10, [6, 8, 10]), (14, [10, 12, 14])):
    run.run(_config(train_steps=train_steps, keep_checkpoints=3), str(workdir))
    assert sorted(int(p.name[5:-6]) for p in (workdir / "checkpoints").glob("ckpt-*.index")) == kept


@pytest.mark.parametrize("how", ["moved", "copied", "absolute_state_moved"])
def test_a_workdir_moved_or_copied_after_its_state_file_was_rebuilt_resumes_from_itself(
    trained, tmp_path, how):
  """The rebuilt state file held absolute paths: moved, the workdir failed with TF's NotFoundError
  on every rerun; copied, the copy resumed from the original's files and pruned them (a probe,
  2026-12-07). A state file with absolute paths (an earlier version, a tool) is rewritten."""
  original = _copy(trained, tmp_path)
  directory = str(original / "checkpoints")
  if how.startswith("absolute"):
    paths = [f"{directory}/ckpt-{n}" for n in (2, 4, 6)]
    tf.compat.v1.train.update_checkpoint_state(directory, paths[-1], paths)
  else:
    (original / "checkpoints" / "checkpoint").unlink()
    run.run(_config(), str(original))  # Finished: it rebuilds the state file, saves nothing.
  reference = {int(p.name[5:-6]) for p in (original / "checkpoints").glob("ckpt-*.index")}
  moved = tmp_path / "elsewhere"
  (shutil.copytree if how == "copied" else shutil.move)(str(original), str(moved))
  result = run.run(_config(train_steps=10, keep_checkpoints=3), str(moved))
  assert result["global_step"] == 10
  state = (moved / "checkpoints" / "checkpoint").read_text()
  assert str(tmp_path) not in state, state  # Bare names, read relative to the directory.
  if how == "copied":  # The original is untouched and still resumes.
    assert {int(p.name[5:-6]) for p in (original / "checkpoints").glob("ckpt-*.index")} == (
        reference)
    assert run.run(_config(train_steps=8), str(original))["global_step"] == 8


def test_damaged_copies_are_all_kept(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  aside = workdir / "checkpoints" / "damaged"
  for round_, train_steps in ((1, 6), (2, 6)):
    shutil.copy(next((trained / "checkpoints").glob("ckpt-6.data-*")), workdir / "checkpoints")
    shutil.copy(trained / "checkpoints" / "ckpt-6.index", workdir / "checkpoints")
    helpers.damage_checkpoint(workdir, "data_truncated" if round_ == 1 else "data_zeroed")
    run.run(_config(train_steps=train_steps), str(workdir))  # Resumes from 4, saves 6 again.
  copies = {p.name.split(".")[0]: p.stat().st_size for p in aside.glob("ckpt-6*.data-*")}
  assert sorted(copies) == ["ckpt-6", "ckpt-6_1"], copies  # Each a prefix with its own index.
  assert copies["ckpt-6"] == 50 and copies["ckpt-6_1"] > 50  # The truncated one, the zeroed one.
  assert sorted(p.name for p in aside.glob("ckpt-6*.index")) == ["ckpt-6.index", "ckpt-6_1.index"]


@pytest.mark.parametrize("content", [b"\xff\xfe\x80 not text \x00", b""])
def test_a_lock_file_with_any_bytes_is_taken_over(trained, tmp_path, content):
  workdir = _copy(trained, tmp_path)
  (workdir / ".lock").write_bytes(content)
  assert run.run(_config(train_steps=8), str(workdir))["global_step"] == 8


def test_a_lock_path_that_cannot_be_opened_is_one_line(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  (workdir / ".lock").unlink()  # The trained run left it empty.
  (workdir / ".lock").mkdir()
  with pytest.raises(errors.ConfigError, match="cannot open its lock file .*Is a directory"):
    run.run(_config(train_steps=8), str(workdir))


@pytest.mark.parametrize("name,make", [
    ("config.json", "directory"), ("summaries/train", "file"), ("summaries/eval", "file"),
    ("checkpoints/damaged", "file"), ("checkpoints/checkpoint", "directory")])
def test_a_workdir_entry_of_the_wrong_kind_is_one_line(trained, tmp_path, name, make):
  workdir = _copy(trained, tmp_path)
  path = workdir / name
  if path.is_dir():
    shutil.rmtree(path)
  elif path.exists():
    path.unlink()
  if make == "directory":
    path.mkdir()
  else:
    path.write_text("x")
  with pytest.raises(errors.ConfigError, match=f"holds a {make} named '{name}' where the run"):
    run.run(_config(train_steps=8), str(workdir))


def test_a_full_disk_during_export_has_the_storage_exit_and_leaves_no_partial(
    trained, tmp_path, monkeypatch):
  workdir = _copy(trained, tmp_path)

  def full(self, path, *args, **kwargs):
    del self, args, kwargs
    tf.io.gfile.makedirs(path)  # Some files were written before the disk filled.
    raise tf.errors.ResourceExhaustedError(None, None, f"{path}: No space left on device")
  monkeypatch.setattr(keras.Model, "export", full)
  with pytest.raises(checkpointing.CheckpointWriteError, match="cannot write the export .*/6 "
                                                               r"\(ResourceExhaustedError"):
    run.run(_config(mode="export"), str(workdir))
  assert not list((workdir / "export").iterdir())


def test_setting_damaged_files_aside_in_a_read_only_directory_is_a_storage_error(
    trained, tmp_path, monkeypatch):
  workdir = _copy(trained, tmp_path)
  helpers.damage_checkpoint(workdir, "data_truncated")

  def read_only(*args, **kwargs):
    raise tf.errors.PermissionDeniedError(None, None, "Read-only file system")
  monkeypatch.setattr(checkpointing.tf.io.gfile, "rename", read_only)
  with pytest.raises(checkpointing.CheckpointWriteError, match="cannot set the damaged "
                                                               "checkpoint.*aside"):
    run.run(_config(train_steps=8), str(workdir))


def test_a_checkpoint_of_another_model_is_the_last_line(tmp_path):
  """TF's warnings about the checkpoint's unmatched values used to follow the error line."""
  recipe = "configs/fashion_mnist.py:smoke,synthetic"
  first = helpers.run_cli(tmp_path, recipe, "train_steps=2", "mode=train", "model=mlp",
                          "export_at_end=False", timeout=180)
  assert first.returncode == 0, first.stderr[-2000:]
  second = helpers.run_cli(tmp_path, recipe, "train_steps=4", "mode=train", "model=small_cnn",
                           "allow_config_change=model", "export_at_end=False", timeout=180)
  assert second.returncode == 2, second.stderr[-2000:]
  last = second.stderr.strip().splitlines()[-1]
  assert last.startswith("microstep: error: the checkpoint") and "does not match" in last, (
      second.stderr[-2000:])


@pytest.mark.parametrize("name,before,after,refused", [
    ("sgd", 0.9, 0.0, True), ("sgd", 0.0, 0.9, True), ("sgd", 0.9, 0.95, False)])
def test_sgd_momentum_may_change_but_not_appear_or_vanish(tmp_path, name, before, after,
                                                          refused):
  """Momentum 0.9 -> 0 used to resume silently without the momentum slots."""
  opt = lambda momentum, steps: _config(**{"optimizer.name": name, "train_steps": steps,
                                           "optimizer.momentum": momentum})
  run.run(opt(before, 2), str(tmp_path))
  if not refused:
    assert run.run(opt(after, 4), str(tmp_path))["global_step"] == 4
    return
  with pytest.raises(errors.ConfigError, match=f"changed `optimizer.momentum` \\({before!r} -> "
                                               f"{after!r}\\)"):
    run.run(opt(after, 4), str(tmp_path))


def test_a_failed_move_of_a_complete_export_keeps_it(trained, tmp_path, monkeypatch):
  workdir = _copy(trained, tmp_path)
  from trainer import export  # pylint: disable=g-import-not-at-top

  def refuse(*args, **kwargs):
    raise tf.errors.PermissionDeniedError(None, None, "Read-only file system")
  monkeypatch.setattr(export.tf.io.gfile, "rename", refuse)
  with pytest.raises(checkpointing.CheckpointWriteError, match="cannot move the complete export"):
    run.run(_config(mode="export"), str(workdir))
  kept, = (workdir / "export").glob("6.partial.*")
  assert (kept / "saved_model.pb").exists()


def test_an_export_beside_another_of_the_same_update_keeps_one_complete_copy(
    trained, tmp_path, monkeypatch):
  """A `mode=export` beside a trainer exporting the same update shared one `6.partial`: each
  deleted the other's files, and one died with a NotFound traceback (found 2026-12-05). Now each
  writes its own; whichever comes second keeps the complete copy in place."""
  workdir = _copy(trained, tmp_path)
  from trainer import export  # pylint: disable=g-import-not-at-top
  exports = workdir / "export"
  exports.mkdir(exist_ok=True)
  (exports / "6.partial").mkdir()  # An older microstep's, killed while exporting.
  (exports / "6.partial.999999999").mkdir()  # A dead process's.
  (exports / "6.partial.1").mkdir()  # A live process's (pid 1): left alone.
  real_rename = export.tf.io.gfile.rename

  def other_process_first(source, target, *args, **kwargs):
    if not str(target).startswith(str(exports)):  # E.g. result.export.json, written atomically.
      return real_rename(source, target, *args, **kwargs)
    real_rename(source, str(exports / "other"))  # The other process's complete copy lands...
    real_rename(str(exports / "other"), target)
    raise tf.errors.AlreadyExistsError(None, None, f"{target} exists")  # ...before ours.
  monkeypatch.setattr(export.tf.io.gfile, "rename", other_process_first)
  assert run.run(_config(mode="export"), str(workdir))["global_step"] == 6
  assert sorted(p.name for p in exports.iterdir()) == ["6", "6.partial.1"]
  assert (exports / "6" / "saved_model.pb").exists()
  monkeypatch.setattr(export.tf.io.gfile, "rename", real_rename)
  before = (exports / "6" / "saved_model.pb").stat().st_mtime_ns
  run.run(_config(mode="export"), str(workdir))  # A complete copy in place is kept.
  assert (exports / "6" / "saved_model.pb").stat().st_mtime_ns == before
  assert sorted(p.name for p in exports.iterdir()) == ["6", "6.partial.1"]


def _export_weights(path) -> dict:
  reader = tf.train.load_checkpoint(str(path / "variables" / "variables"))
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith("variables/")}  # The model's weights, in the checkpoint's order.


def test_an_export_of_another_run_at_the_same_update_is_replaced_and_set_aside(trained, tmp_path):
  """The checkpoints deleted and the run trained again from 0 (other learning rate): the second
  run found export/6 complete and kept it, a model of the first run, while its log and
  result.json said it had exported its own (a probe, 2026-12-07)."""
  workdir = _copy(trained, tmp_path)
  first = run.run(_config(mode="export"), str(workdir))["export"]
  old = _export_weights(workdir / "export" / "6")
  shutil.rmtree(workdir / "checkpoints")
  second = run.run(_config(**{"optimizer.learning_rate": 0.01, "export_at_end": True}),
                   str(workdir))
  assert second["export"] == first == str(workdir / "export" / "6")
  new = _export_weights(workdir / "export" / "6")
  _, trained_now = helpers.checkpoint_weights(workdir)
  for exported, checkpointed in zip(sorted(new, key=lambda k: int(k.split("/")[1])),
                                    sorted(trained_now)):
    np.testing.assert_array_equal(new[exported], trained_now[checkpointed])  # This run's model.
  assert any(not np.array_equal(new[k], old[k]) for k in new)
  aside, = (workdir / "export").glob("6.replaced.*")  # Nothing is lost.
  aside_weights = _export_weights(aside)
  assert all(np.array_equal(aside_weights[k], old[k]) for k in old)
  run.run(_config(mode="export"), str(workdir))  # The same weights again: kept, nothing moved.
  assert len(list((workdir / "export").glob("6.replaced.*"))) == 1


def test_an_earlier_runs_export_that_cannot_be_set_aside_is_not_taken_as_this_runs(
    trained, tmp_path, monkeypatch):
  workdir = _copy(trained, tmp_path)
  run.run(_config(mode="export"), str(workdir))
  old = _export_weights(workdir / "export" / "6")
  shutil.rmtree(workdir / "checkpoints")
  from trainer import export  # pylint: disable=g-import-not-at-top
  real_rename = export.tf.io.gfile.rename

  def refuse_aside(source, target, *args, **kwargs):
    if ".replaced." in str(target):
      raise tf.errors.PermissionDeniedError(None, None, f"{target}; Permission denied")
    return real_rename(source, target, *args, **kwargs)
  monkeypatch.setattr(export.tf.io.gfile, "rename", refuse_aside)
  with pytest.raises(checkpointing.CheckpointWriteError, match="cannot move the complete export"):
    run.run(_config(**{"optimizer.learning_rate": 0.01, "export_at_end": True}), str(workdir))
  unchanged = _export_weights(workdir / "export" / "6")
  assert all(np.array_equal(unchanged[k], old[k]) for k in old)
  kept, = (workdir / "export").glob("6.partial.*")  # This run's model, for a person to move.
  assert (kept / "saved_model.pb").exists()


def test_a_checkpoint_deleted_while_an_evaluator_reads_it_is_not_damage(trained, tmp_path,
                                                                        monkeypatch):
  """Beside a live trainer keeping one checkpoint, `mode=eval` listed ckpt-6, the trainer deleted
  it for a newer one, and the evaluator called the run's checkpoints unreadable (exit 2, "move
  them away"; found 2026-12-05). It lists again and reads the one that is there."""
  workdir = _copy(trained, tmp_path)
  checkpoints, hidden = workdir / "checkpoints", tmp_path / "newer"
  hidden.mkdir()
  for path in checkpoints.glob("ckpt-4.*"):  # Saved "later": not there when the reader lists.
    path.rename(hidden / path.name)
  for path in checkpoints.glob("ckpt-2.*"):
    path.unlink()
  real = checkpointing.restore_one

  def trainer_saves_and_deletes_meanwhile(checkpoint, prefix, strategy):
    if prefix.endswith("ckpt-6"):
      for path in checkpoints.glob("ckpt-6.*"):
        path.unlink()
      for path in hidden.iterdir():
        path.rename(checkpoints / path.name)
      return "NotFoundError: ckpt-6.data-00000-of-00001; No such file or directory"
    return real(checkpoint, prefix, strategy)
  monkeypatch.setattr(checkpointing, "restore_one", trainer_saves_and_deletes_meanwhile)
  result = run.run(_config(mode="eval"), str(workdir))
  assert result["global_step"] == 4 and np.isfinite(result["eval"]["loss"])
  assert not (checkpoints / "damaged").exists()


def test_a_checkpoint_deleted_halfway_through_a_restore_is_not_another_model(tmp_path):
  """TF's restore of a checkpoint whose files vanish halfway reports unmatched objects; that read
  as 'does not match this config' (the reader-beside-trainer race above)."""
  prefix = tf.train.Checkpoint(v=tf.Variable(1.0)).save(str(tmp_path / "ckpt"))

  class Status:
    def assert_existing_objects_matched(self):
      raise AssertionError("Unresolved object in checkpoint")

    def expect_partial(self):
      pass

  class DeletedWhileRead:
    def restore(self, path):
      for name in tf.io.gfile.glob(path + ".*"):
        tf.io.gfile.remove(name)
      return Status()
  damage = checkpointing.restore_one(DeletedWhileRead(), prefix, tf.distribute.get_strategy())
  assert damage == f"NotFoundError: {prefix} was deleted while read"
  with pytest.raises(errors.ConfigError, match="does not match this config"):
    prefix = tf.train.Checkpoint(v=tf.Variable(1.0)).save(str(tmp_path / "kept"))
    checkpointing.restore_one(type("Other", (), {"restore": lambda self, p: Status()})(),
                              prefix, tf.distribute.get_strategy())
