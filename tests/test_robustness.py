"""Nothing lost, ever (issue 11): the workdir lock, damaged checkpoints, the resume guard, signals
from the first second, the command line's one-line errors. Rows of docs/robustness.md.

CLI runs go through `helpers.run_cli` or a Popen this test owns (ended by its PID).
"""
import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import helpers
from trainer import checkpointing
from trainer import errors
from trainer import exit_codes
from trainer import run
from trainer import workdir as workdir_lib

RECIPE = "configs/fashion_mnist.py:smoke,synthetic"
DETERMINISTIC = ("deterministic=True", "mode=train", "export_at_end=False", "steps_per_loop=2",
                 "checkpoint_every=2")


def _error_line(out):
  lines = out.stderr.strip().splitlines()
  assert lines and lines[-1].startswith("microstep: error: "), out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  return lines[-1][len("microstep: error: "):]


def _popen(workdir, *overrides):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=os.pathsep.join([helpers.REPO, helpers.TESTS]))
  return subprocess.Popen(
      [sys.executable, "-m", "trainer.main", f"--config={helpers.REPO}/{RECIPE}",
       f"--workdir={workdir}"] + [f"--config.{o}" for o in overrides],
      cwd=helpers.REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=120):
  try:
    _, err = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=30)
  return proc.returncode, err


def _wait_for(proc, text, timeout=120):
  """Reads the trainer's stderr until `text` appears; returns what was read."""
  deadline, seen = time.time() + timeout, []
  for line in proc.stderr:
    seen.append(line)
    if text in line or time.time() > deadline:
      break
  return "".join(seen)


# ----------------------------------------------------------- the command line, one line -------
@pytest.mark.parametrize("args,message", [
    (["--config=/nonexistent/cfg.py"], "`--config`=/nonexistent/cfg.py cannot be loaded: [Errno 2]"),
    (["--config=SYNTAX"], "invalid syntax (line 1)"),
    (["--config=RAISES"], "get_config raised RuntimeError: boom in config"),
    # The file reads a group it never made: its own error, not an override's (there is none).
    (["--config=MISSING"], "missing.py: get_config raised AttributeError: \"'my_group'\""),
    (["--config=MISSING", "--config.batch_size=8"],
     "missing.py: get_config raised AttributeError: \"'my_group'\""),
    # get_config returned no ConfigDict: was "an unknown field 'int' object has no attribute
    # 'keys'" and "Flag --config must have a value other than None" (a probe, 2026-12-07).
    (["--config=RETURNS_INT"], "int.py: get_config returned int; it must return an "
                               "ml_collections.ConfigDict"),
    (["--config=RETURNS_NONE"], "none.py: get_config returned None (a forgotten `return "
                                "config`?); it must return an ml_collections.ConfigDict"),
    ([f"--config={RECIPE}", "--config.nope=1"],
     "`--config.nope` is not a field; allowed in the config: accumulation,"),
    ([f"--config={RECIPE}", "--config.batch_size.x=3"],
     "`--config.batch_size.x`: `batch_size` is a value, not a group of fields"),
    ([f"--config={RECIPE}", "--config.optimizer.lr=1"],
     "`--config.optimizer.lr` is not a field; allowed in optimizer: beta_1,"),
    (["--config=configs/fashion_mnist.py:smoke,bogus"],
     "config arg ['bogus'] unknown; allowed: ['smoke', 'synthetic']"),
    ([f"--config={RECIPE}", "--config.batch_size=abc"],
     "flag --config.batch_size=abc: invalid literal for int()"),
    ([f"--config={RECIPE}", "--workdirx=3"], "Unknown command line flag 'workdirx'"),
    ([f"--config={RECIPE}", "extra"], "unexpected arguments ['extra']"),
    # A get_config that builds its own config: a KeyError traceback, exit 1 (a probe,
    # 2026-12-08).
    (["--config=PARTIAL"], "the config lacks `accumulation`, `allow_config_change`, "
                           "`checkpoint_every`, `collective_timeout_s`, `contrastive` and "),
    (["--config=DICT"], "the config is a dict, not an ml_collections.ConfigDict; start "
                        "get_config from `config = config_defaults.base_config()`"),
    (["--config=TYPO"], "`per_example.every_step` is not a field (did you mean "
                        "`per_example.every_steps`?); allowed in per_example: every_steps,"),
])
def test_command_line_mistakes_are_one_line_with_exit_2(tmp_path, args, message):
  (tmp_path / "syntax.py").write_text("def get_config(:\n  pass\n")
  (tmp_path / "raises.py").write_text("def get_config(arg=None):\n  raise RuntimeError('boom in config')\n")
  (tmp_path / "missing.py").write_text(
      "import ml_collections\ndef get_config(arg=None):\n"
      "  c = ml_collections.ConfigDict({'batch_size': 4})\n  c.my_group.size = 3\n  return c\n")
  (tmp_path / "int.py").write_text("def get_config(arg=None):\n  return 5\n")
  (tmp_path / "partial.py").write_text(
      "import ml_collections\ndef get_config(arg=None):\n  return ml_collections.ConfigDict("
      "{'task': 'classification', 'batch_size': 32, 'train_steps': 10})\n")
  (tmp_path / "dict.py").write_text("def get_config(arg=None):\n  return {'batch_size': 32}\n")
  (tmp_path / "none.py").write_text("import ml_collections\ndef get_config(arg=None):\n"
                                    "  c = ml_collections.ConfigDict({'batch_size': 4})\n")
  # A misspelt field of microstep's own group, in the file (ml_collections takes it silently).
  recipe, _, recipe_arg = RECIPE.partition(":")
  (tmp_path / "typo.py").write_text(
      "import importlib.util\n"
      f"spec = importlib.util.spec_from_file_location('r', {os.path.join(helpers.REPO, recipe)!r})\n"
      "recipe = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(recipe)\n"
      f"def get_config(arg=''):\n  c = recipe.get_config({recipe_arg!r})\n"
      "  c.per_example.every_step = 1\n  return c\n")
  args = [a.replace("SYNTAX", str(tmp_path / "syntax.py")).replace("RAISES", str(tmp_path / "raises.py"))
          .replace("TYPO", str(tmp_path / "typo.py")).replace("MISSING", str(tmp_path / "missing.py"))
          .replace("RETURNS_INT", str(tmp_path / "int.py"))
          .replace("PARTIAL", str(tmp_path / "partial.py")).replace("DICT", str(tmp_path / "dict.py"))
          .replace("RETURNS_NONE", str(tmp_path / "none.py"))
          for a in args]
  if not any(a.startswith("--workdir") for a in args):
    args.append(f"--workdir={tmp_path / 'w'}")
  done = subprocess.run(["timeout", "-k", "5", "120", sys.executable, "-m", "trainer.main"] + args,
                        cwd=helpers.REPO, capture_output=True, text=True, timeout=140, check=False,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert done.returncode == exit_codes.BAD_INPUT_EXIT_CODE, done.stderr[-2000:]
  assert message in _error_line(done)


def test_tf_config_index_beyond_the_cluster_is_one_line(tmp_path):
  tf_config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
               "task": {"type": "worker", "index": 5}}
  out = helpers.run_cli(tmp_path, RECIPE, "strategy=multi_worker_mirrored", timeout=120,
                        extra_env={"TF_CONFIG": json.dumps(tf_config)})
  assert out.returncode == 2
  assert "TF_CONFIG task 'worker' index 5 is not in the cluster {'worker': 2}" in _error_line(out)


# ------------------------------------------------------------------------- the workdir --------
def test_two_runs_in_one_workdir_second_exits_2_first_finishes_bitwise(tmp_path):
  long_enough = ("train_steps=600", "steps_per_loop=50", "checkpoint_every=50")
  solo = helpers.run_cli(tmp_path / "solo", RECIPE, *DETERMINISTIC, *long_enough)
  assert solo.returncode == 0, solo.stderr[-2000:]
  first = _popen(tmp_path / "shared", *DETERMINISTIC, *long_enough)
  try:
    _wait_for(first, "restoring or initializing model")
    # Paused, so that it is still live (holding its lock) while the second starts, however
    # fast it trains and slowly the second imports on a loaded machine.
    os.kill(first.pid, signal.SIGSTOP)
    started = time.time()
    second = helpers.run_cli(tmp_path / "shared", RECIPE, "seed=1", *DETERMINISTIC,
                             *long_enough, timeout=60)
    assert time.time() - started < 30
    assert second.returncode == 2, second.stderr[-2000:]
    line = _error_line(second)
    assert "is in use by a live run (mode=train, host" in line, line
    assert f"pid {first.pid}," in line, line
  finally:
    os.kill(first.pid, signal.SIGCONT)
    code, err = _finish(first)
  assert code == 0, err[-2000:]
  helpers.assert_same_weights(tmp_path / "solo", tmp_path / "shared")


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
  (tmp_path / ".lock").write_text("host gone, pid 999999, started 2026-01-01T00:00:00\n")
  result = run.run(helpers.tiny_config(**{"train_steps": 2, "steps_per_loop": 2}), str(tmp_path))
  assert result["global_step"] == 2
  assert (tmp_path / ".lock").read_text() == "", "released at the end of the run"


def test_checkpoints_being_a_file_is_one_line(tmp_path):
  (tmp_path / "checkpoints").write_text("not a directory")
  with pytest.raises(errors.ConfigError, match="holds a file named 'checkpoints'"):
    run.run(helpers.tiny_config(), str(tmp_path))


@pytest.mark.parametrize("name,make_directory", [("result.json", True), ("data_state", False)])
def test_a_result_or_data_state_of_the_wrong_kind_is_one_line_before_training(tmp_path, name,
                                                                             make_directory):
  """Found by a probe (2026-12-06): a directory `result.json` failed after all the training
  (traceback, exit 1); a file `data_state` at the first checkpoint of a tf.data run."""
  if make_directory:
    (tmp_path / name).mkdir()
  else:
    (tmp_path / name).write_text("not a directory")
  kind = "a directory" if make_directory else "a file"
  with pytest.raises(errors.ConfigError, match=f"holds {kind} named '{name}'"):
    run.run(helpers.tiny_config(), str(tmp_path))


def test_an_evaluator_runs_beside_a_live_trainer(tmp_path):
  """Evaluators only read checkpoints: they take their own lock, repair nothing, and leave the
  trainer's config.json and result.json alone."""
  trainer = _popen(tmp_path, "train_steps=100000", *DETERMINISTIC)
  try:
    _wait_for(trainer, "train step")
    config_before = (tmp_path / "config.json").read_text()
    evaluator = helpers.run_cli(tmp_path, RECIPE, "mode=eval", "deterministic=True", timeout=120)
    assert evaluator.returncode == 0, evaluator.stderr[-2000:]
    assert (tmp_path / "result.eval.json").exists() and not (tmp_path / "result.json").exists()
    assert (tmp_path / "config.json").read_text() == config_before
  finally:
    trainer.send_signal(signal.SIGTERM)
    code, err = _finish(trainer, timeout=60)
  assert code == exit_codes.PREEMPTED_EXIT_CODE, err[-2000:]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_workdir_path_that_is_not_utf8_is_one_line_and_creates_nothing(tmp_path, mode):
  """A traceback from TensorFlow's `as_bytes` (a probe, 2026-12-07); training made the
  directory first."""
  workdir = os.path.join(str(tmp_path), os.fsdecode(b"run-\xff"))
  with pytest.raises(errors.ConfigError, match=r"^`--workdir`='.*run-\\udcff' is not valid "
                     "UTF-8, which TensorFlow's file system needs"):
    run.run(helpers.tiny_config(mode=mode), workdir)
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("name", ["sweep[lr=0.1]", "run?", "a*b", "back\\slash"])
def test_a_workdir_path_with_a_glob_character_is_one_line_and_creates_nothing(tmp_path, name):
  """TensorFlow finds checkpoints by glob: in `sweep[lr=0.1]` a run saw none of its own and
  restarted from update 0; `run?` restored a sibling `runA`'s checkpoint (a probe, 2026-12-07)."""
  with pytest.raises(errors.ConfigError, match=r"^`--workdir`='.*' holds .*, which TensorFlow "
                     "reads as a glob pattern when it looks for checkpoints"):
    run.run(helpers.tiny_config(), os.path.join(str(tmp_path), name))
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("workdir", ["s3://bucket/run", "file://{tmp}/run", "hdfs://nn/run"])
def test_a_workdir_url_other_than_gs_is_one_line_and_creates_nothing(tmp_path, monkeypatch,
                                                                    workdir):
  """`s3://bucket/x` was TF's UnimplementedError traceback after a tree `s3:/bucket/x/.lock`
  was made in the current directory; with `file://DIR` the lock went to `./file:/DIR` while
  TensorFlow wrote into DIR, so a second run on DIR was not refused and both trained and saved
  there at once (a probe, 2026-12-07)."""
  monkeypatch.chdir(tmp_path)
  workdir = workdir.format(tmp=tmp_path)
  with pytest.raises(errors.ConfigError, match=r"^`--workdir`='[a-z0-9]+://.*' is a URL that "
                     r"microstep does not take; allowed: a local path or gs://"):
    run.run(helpers.tiny_config(), workdir)
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("streams", ["stdout", "stdout_and_stderr", "terminal"])
def test_a_reader_of_the_output_that_goes_away_does_not_stop_the_run(tmp_path, streams):
  """`... | head -1`: the next print raised BrokenPipeError in Orbit's progress line and killed
  the run, exit 1, the updates since the last checkpoint lost (`2>&1 | head`: before the first
  checkpoint; a probe, 2026-12-07). A closed terminal (a pseudo-terminal whose other end is
  closed) fails the writes with EIO instead. The run goes on to its end, output dropped."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
  reader = writer = None
  if streams == "terminal":
    reader, writer = pty.openpty()
  with open(tmp_path / "stderr.txt", "w") as err:
    proc = subprocess.Popen(
        ["timeout", "-k", "5", "240", sys.executable, "-m", "trainer.main",
         f"--config={helpers.REPO}/{RECIPE}", f"--workdir={tmp_path / 'w'}",
         "--config.train_steps=20", "--config.steps_per_loop=2"],
        cwd=helpers.REPO, env=env, stdout=writer or subprocess.PIPE,
        stderr=subprocess.STDOUT if streams == "stdout_and_stderr" else err)
    if reader is None:
      proc.stdout.readline()  # The reader takes one line and goes.
      proc.stdout.close()
    else:
      os.close(writer)
      while b"\n" not in os.read(reader, 4096):  # The first line, then the terminal closes.
        pass
      os.close(reader)
    code = proc.wait(timeout=260)
  assert code == 0, (tmp_path / "stderr.txt").read_text()[-2000:]
  assert json.loads((tmp_path / "w" / "result.json").read_text())["global_step"] == 20
  assert "BrokenPipeError" not in (tmp_path / "stderr.txt").read_text()


def test_a_second_evaluator_is_told_that_an_evaluator_holds_the_workdir(tmp_path):
  """Evaluators of one mode share a lock; the refusal said "a live run", which read as a
  trainer beside which evaluators are documented to run (a probe, 2026-12-07)."""
  run.run(helpers.tiny_config(mode="train"), str(tmp_path))
  with workdir_lib.Lock(str(tmp_path), "continuous_eval", role="mode=continuous_eval"):
    with pytest.raises(errors.ConfigError, match=r"is in use by a live run \(mode=continuous_eval, "
                       rf"host \S+, pid {os.getpid()}, started "):
      run.run(helpers.tiny_config(mode="continuous_eval", eval_timeout_s=1), str(tmp_path))
    assert run.run(helpers.tiny_config(mode="eval"), str(tmp_path))["global_step"] == 3


@pytest.mark.parametrize("mode", ["eval", "export"])
def test_eval_or_export_on_an_empty_workdir_is_one_line(tmp_path, mode):
  with pytest.raises(errors.ConfigError, match=f"`mode`={mode} but `--workdir`=.* holds no "
                                               "checkpoint"):
    run.run(helpers.tiny_config(mode=mode), str(tmp_path / "typo"))
  assert not (tmp_path / "typo").exists()  # It was created, with a lock file in it.


# ----------------------------------------------------------------- damaged checkpoints --------
@pytest.mark.parametrize("how,resumed_from", [
    ("state_deleted", 6), ("state_garbage", 6), ("state_names_missing", 6),
    ("data_truncated", 4), ("data_zeroed", 4), ("index_missing", 4), ("index_garbage", 4)])
def test_a_damaged_workdir_resumes_from_the_newest_intact_checkpoint(tmp_path, how,
                                                                     resumed_from):
  config = lambda steps: helpers.tiny_config(**{"train_steps": steps, "steps_per_loop": 2,
                                                "checkpoint_every": 2, "mode": "train"})
  run.run(config(6), str(tmp_path))
  helpers.damage_checkpoint(tmp_path, how)
  strategy, trainer = helpers.build(config(8), tmp_path)
  del strategy
  assert int(trainer.global_step.numpy()) == resumed_from
  assert trainer.restored_checkpoint.endswith(f"ckpt-{resumed_from}")
  state = tf.train.get_checkpoint_state(str(tmp_path / "checkpoints"))
  assert os.path.basename(state.model_checkpoint_path) == f"ckpt-{resumed_from}"
  if resumed_from == 4 and how != "index_missing":  # Without its index ckpt-6 is no checkpoint.
    assert list((tmp_path / "checkpoints" / "damaged").glob("ckpt-6.*")), "kept, set aside"


@pytest.mark.parametrize("how", ["state_deleted", "data_truncated"])
def test_rerun_after_damage_finishes_bitwise_equal_to_an_uninterrupted_run(tmp_path, how):
  solo = helpers.run_cli(tmp_path / "solo", RECIPE, "train_steps=10", *DETERMINISTIC)
  assert solo.returncode == 0, solo.stderr[-2000:]
  first = helpers.run_cli(tmp_path / "damaged", RECIPE, "train_steps=6", *DETERMINISTIC)
  assert first.returncode == 0, first.stderr[-2000:]
  helpers.damage_checkpoint(tmp_path / "damaged", how)
  rerun = helpers.run_cli(tmp_path / "damaged", RECIPE, "train_steps=10", *DETERMINISTIC)
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  expected = "at update 6" if how == "state_deleted" else "at update 4"
  assert expected in rerun.stderr
  if how == "data_truncated":
    warnings = [l for l in rerun.stderr.splitlines() if "skipped damaged checkpoint" in l]
    assert len(warnings) == 1 and "ckpt-6" in warnings[0], warnings
  helpers.assert_same_weights(tmp_path / "solo", tmp_path / "damaged")


def test_no_readable_checkpoint_is_one_line_and_nothing_is_overwritten(tmp_path):
  run.run(helpers.tiny_config(**{"train_steps": 2, "steps_per_loop": 2, "checkpoint_every": 2,
                                 "mode": "train"}), str(tmp_path))
  data = next((tmp_path / "checkpoints").glob("ckpt-2.data-*"))
  data.write_bytes(b"\x00" * 10)
  before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
  with pytest.raises(errors.ConfigError, match="no checkpoint in .* reads back"):
    run.run(helpers.tiny_config(**{"train_steps": 4, "mode": "train"}), str(tmp_path))
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
  assert data.read_bytes() == b"\x00" * 10


def _crash_worker(tmp_path, phase, *overrides):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=os.pathsep.join([helpers.REPO, helpers.TESTS]))
  return subprocess.run(
      ["timeout", "-k", "5", "240", sys.executable, os.path.join(helpers.TESTS, "crash_worker.py"),
       phase, f"--config={helpers.REPO}/{RECIPE}", f"--workdir={tmp_path}"]
      + [f"--config.{o}" for o in DETERMINISTIC + overrides],
      cwd=helpers.REPO, env=env, capture_output=True, text=True, timeout=260, check=False)


def _run_with_file_size_limit(workdir, limit_bytes, *overrides):
  """The CLI under a real `ulimit -f` (RLIMIT_FSIZE): a write past it fails with EFBIG."""
  import resource  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  return subprocess.run(
      [sys.executable, "-m", "trainer.main", f"--config={helpers.REPO}/{RECIPE}",
       f"--workdir={workdir}"] + [f"--config.{o}" for o in DETERMINISTIC + overrides],
      cwd=helpers.REPO, env=env, capture_output=True, text=True, timeout=240, check=False,
      preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes)))


def test_a_file_over_a_size_limit_has_the_storage_exit_not_empty_data(tmp_path):
  """TensorFlow raises EFBIG as OutOfRangeError: a checkpoint past `ulimit -f` read as "the
  training data yields no batch" (exit 2), and an export's was a traceback (a probe,
  2026-12-07). The checkpoint's data file is 3.6 MB; 1 MB lets the small files through."""
  done = _run_with_file_size_limit(tmp_path, 1_000_000, "train_steps=4")
  assert done.returncode == exit_codes.CHECKPOINT_IO_EXIT_CODE, done.stderr[-2000:]
  line = _error_line(done)
  assert line.startswith(f"cannot write a checkpoint to {tmp_path}/checkpoints (OutOfRangeError:")
  assert "File too large); a limit on file size (`ulimit -f`" in line, line
  assert not list((tmp_path / "checkpoints").glob("ckpt-*"))  # Its scratch files removed.
  trained = helpers.run_cli(tmp_path, RECIPE, "train_steps=2", *DETERMINISTIC)
  assert trained.returncode == 0, trained.stderr[-2000:]
  done = _run_with_file_size_limit(tmp_path, 1_000_000, "mode=export")
  assert done.returncode == exit_codes.CHECKPOINT_IO_EXIT_CODE, done.stderr[-2000:]
  assert "File too large); a limit on file size" in _error_line(done)
  assert not list((tmp_path / "export").glob("*partial*"))


def test_a_full_disk_during_a_save_has_its_own_exit_code(tmp_path):
  done = _crash_worker(tmp_path, "disk_full:4", "train_steps=8")
  assert done.returncode == exit_codes.CHECKPOINT_IO_EXIT_CODE, done.stderr[-2000:]
  line = _error_line(done)
  assert "cannot write a checkpoint" in line and "disk full?" in line and "ckpt-2" in line
  assert "No space left on device" in line and "{{" not in line  # TF's cause, not its wrapping.
  latest = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
  assert latest.endswith("ckpt-2")
  tf.train.load_checkpoint(latest)
  # The failed save's scratch directory is gone: it held space the disk has not got.
  assert sorted(os.listdir(tmp_path / "checkpoints")) == [
      "checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]


def test_scratch_files_of_a_killed_save_are_removed_when_the_run_resumes(tmp_path):
  first = helpers.run_cli(tmp_path, RECIPE, "train_steps=4", *DETERMINISTIC)
  assert first.returncode == 0, first.stderr[-2000:]
  # A save killed halfway (kill -9); a number this run never saves (TF would clean its own).
  scratch = tmp_path / "checkpoints" / "ckpt-5_temp"
  scratch.mkdir()
  (scratch / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"x" * 1000)
  keep = tmp_path / "checkpoints" / "notes_temp"  # Not TF's scratch: not ours to delete.
  keep.mkdir()
  second = helpers.run_cli(tmp_path, RECIPE, "train_steps=8", *DETERMINISTIC)
  assert second.returncode == 0, second.stderr[-2000:]
  assert not scratch.exists() and keep.is_dir()
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-8")


def test_a_checkpoint_directory_deleted_during_a_save_is_one_line(tmp_path):
  done = _crash_worker(tmp_path, "dir_gone:4", "train_steps=8")
  assert done.returncode == exit_codes.CHECKPOINT_IO_EXIT_CODE, done.stderr[-2000:]
  line = _error_line(done)
  assert f"{tmp_path}/checkpoints is gone (deleted or moved" in line, line
  assert "NotFoundError" in line


def test_a_full_disk_while_writing_summaries_has_the_storage_exit(tmp_path):
  done = _crash_worker(tmp_path, "summary_disk_full:0", "train_steps=4")
  assert done.returncode == exit_codes.CHECKPOINT_IO_EXIT_CODE, done.stderr[-2000:]
  line = _error_line(done)
  assert line.startswith(f"cannot write to `--workdir`={tmp_path} "), line
  assert "events.out.tfevents.1.host.1.v2; No space left on device)" in line, line
  assert "; disk full? The latest checkpoint is none" in line, line
  assert "Could not initialize" not in line


def test_only_full_or_read_only_storage_counts_as_a_storage_failure(tmp_path):
  def failure(error):
    return checkpointing.storage_write_failure(error, str(tmp_path))
  assert failure(OSError(28, "No space left on device", "result.json")) is not None
  assert failure(OSError(30, "Read-only file system")) is not None
  assert failure(tf.errors.UnknownError(None, None, "x; Disk quota exceeded")) is not None
  # A tensor that does not fit in memory is no storage problem; nor is a missing file.
  assert failure(tf.errors.ResourceExhaustedError(
      None, None, "OOM when allocating tensor with shape[1000000,1000000]")) is None
  assert failure(OSError(2, "No such file or directory")) is None
  assert failure(ValueError("No space left on device")) is None
  # A file in the workdir that may not be written (`chattr +i`): a traceback, exit 1, until a
  # probe (2026-12-07); a file elsewhere that may not be read (the data) is no storage failure.
  assert failure(tf.errors.PermissionDeniedError(
      None, None, f"{tmp_path}/config.json.partial.12; Operation not permitted")) is not None
  assert failure(OSError(1, "Operation not permitted", f"{tmp_path}/result.json")) is not None
  assert failure(OSError(13, "Permission denied", "/data/train.npz")) is None
  assert failure(tf.errors.PermissionDeniedError(None, None, "/data/x; Permission denied")) is None
  # A path component, not a substring: `.` is in /data/train.npz, /data/exp in /data/exp_inputs.
  for workdir, path in ((".", "/data/train.npz"), ("/data/exp", "/data/exp_inputs/x.csv"),
                        ("runs", "/mnt/runs_data/x")):
    denied = tf.errors.PermissionDeniedError(None, None, f"{path}; Permission denied")
    assert checkpointing.storage_write_failure(denied, workdir) is None, workdir
  relative = tf.errors.PermissionDeniedError(None, None, "./result.json.partial.3; Permission "
                                             "denied")
  assert checkpointing.storage_write_failure(relative, ".") is not None
  # The one-line errors guess the cause from the error, not always "disk full?".
  hint = checkpointing.storage_hint
  assert hint(OSError(28, "No space left on device")) == "disk full?"
  assert hint(OSError(30, "Read-only file system")) == "read-only file system?"
  assert hint(tf.errors.PermissionDeniedError(None, None, "x; Read-only file system")) == (
      "read-only file system?")  # Was "no write permission?" (a probe, 2026-12-07).
  assert hint(tf.errors.PermissionDeniedError(None, None, "x; Permission denied")) == (
      "no write permission?")
  assert hint(tf.errors.UnknownError(None, None, "x; Operation not permitted")) == (
      "no write permission?")
  assert hint(tf.errors.UnknownError(None, None, "x; Input/output error")) == "storage failing?"


def test_a_workdir_moved_while_training_stops_the_run_without_a_directory_made_anew(tmp_path):
  workdir, moved = tmp_path / "w", tmp_path / "moved"
  long_enough = ("train_steps=600", "steps_per_loop=50", "checkpoint_every=50")
  first = _popen(workdir, *DETERMINISTIC, *long_enough)
  try:
    _wait_for(first, "restoring or initializing model")
    os.kill(first.pid, signal.SIGSTOP)  # Moved before its first loop ends, however fast.
    os.rename(workdir, moved)
  finally:
    os.kill(first.pid, signal.SIGCONT)
    code, err = _finish(first)
  assert code == exit_codes.CHECKPOINT_IO_EXIT_CODE, err[-2000:]
  line = err.strip().splitlines()[-1]
  assert f"`--workdir`='{workdir}' was deleted or moved while this run used it" in line, line
  assert "Traceback" not in err
  # Before the check, its saves went on in a new `w/checkpoints` beside no config.json, where a
  # rerun was refused and a second run could take the lock (found 2026-12-05). (Moved before
  # the first loop, the TensorBoard writer, made lazily, still opens a new file there.)
  assert not (workdir / "checkpoints").exists() and not (workdir / "config.json").exists()
  shutil.rmtree(workdir, ignore_errors=True)
  os.rename(moved, workdir)
  again = helpers.run_cli(workdir, RECIPE, *DETERMINISTIC, *long_enough)
  assert again.returncode == 0, again.stderr[-2000:]
  assert tf.train.latest_checkpoint(str(workdir / "checkpoints")).endswith("ckpt-600")


def test_an_atomic_write_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
  def full(*args, **kwargs):
    raise tf.errors.ResourceExhaustedError(None, None, "x; No space left on device")
  monkeypatch.setattr(tf.io.gfile, "rename", full)
  with pytest.raises(tf.errors.ResourceExhaustedError):
    workdir_lib.write_atomically(str(tmp_path / "result.json"), "{}")
  assert os.listdir(tmp_path) == []


def test_error_descriptions_drop_tensorflows_wrapping_and_keep_the_cause():
  error = tf.errors.ResourceExhaustedError(
      None, None, "{{function_node __wrapped__SaveV2_dtypes_39_device_/job:localhost/replica:0/"
      "task:0/device:CPU:0}} /w/checkpoints/ckpt-17_temp/part-00000-of-00001.data-00000-of-00001"
      ".tempstate154437642534945375; No space left on device [Op:SaveV2]\n\tmore context")
  text = errors.describe_error(error)
  assert text.startswith("ResourceExhaustedError: /w/checkpoints/ckpt-17_temp/"), text
  assert text.endswith("; No space left on device"), text
  long = errors.describe_error(OSError("a" * 100 + " middle " + "b" * 100 + " cause"))
  assert len(long) < 200 and long.endswith("b cause") and " ... " in long


# -------------------------------------------------------------------------- resume guard -------
def test_resuming_with_a_different_batch_size_is_refused_naming_it(tmp_path):
  first = helpers.run_cli(tmp_path, RECIPE, "train_steps=4", "batch_size=32", *DETERMINISTIC)
  assert first.returncode == 0, first.stderr[-2000:]
  second = helpers.run_cli(tmp_path, RECIPE, "train_steps=8", "batch_size=64", *DETERMINISTIC)
  assert second.returncode == 2
  line = _error_line(second)
  assert "with a changed `batch_size` (32 -> 64)" in line
  assert "--config.allow_config_change=batch_size" in line
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-4")


@pytest.mark.parametrize("before,after,field", [
    ({"optimizer.name": "sgd"}, {"optimizer.name": "adam"}, "optimizer.name"),
    ({"optimizer.name": "sgd"}, {"optimizer.name": "sgd", "optimizer.momentum": 0.9},
     "optimizer.momentum"),
    ({}, {"mixed_precision": "mixed_float16"}, "mixed_precision")])
def test_a_change_that_adds_state_is_refused_even_when_allowed(tmp_path, before, after, field):
  # The guard offered allow_config_change, and the restore then refused the checkpoint as
  # another model's: a dead end (a probe, 2026-12-07). The other way drops state and resumes.
  base = {"train_steps": 2, "steps_per_loop": 2, "checkpoint_every": 2, "mode": "train"}
  run.run(helpers.tiny_config(**base, **before), str(tmp_path / "adds"))
  for allow in ("", field):
    with pytest.raises(errors.ConfigError, match=(
        rf"changed `{field}` \(.*\): the new config keeps .*, which its checkpoints do not hold, "
        "so no run can resume from them; use a fresh workdir")):
      run.run(helpers.tiny_config(**dict(base, train_steps=4, allow_config_change=allow),
                                  **after), str(tmp_path / "adds"))
  run.run(helpers.tiny_config(**base, **after), str(tmp_path / "drops"))
  resumed = run.run(helpers.tiny_config(**dict(base, train_steps=4, allow_config_change=field),
                                        **before), str(tmp_path / "drops"))
  assert resumed["global_step"] == 4


def test_an_allowed_batch_size_change_warns_that_the_stream_position_moves(tmp_path, caplog):
  base = {"train_steps": 2, "steps_per_loop": 2, "checkpoint_every": 2, "mode": "train"}
  run.run(helpers.tiny_config(**base), str(tmp_path))
  with caplog.at_level("WARNING"):
    result = run.run(helpers.tiny_config(**dict(base, train_steps=3, batch_size=32,
                                                allow_config_change="batch_size")), str(tmp_path))
  assert result["global_step"] == 3
  assert ("resuming with `batch_size` 16 -> 32 (allowed): the data position and `examples_seen` "
          "count micro-batches") in caplog.text
  assert "the examples between the old position and the new are skipped" in caplog.text


def test_an_unknown_field_in_allow_config_change_is_one_line(tmp_path):
  with pytest.raises(errors.ConfigError, match=r"^`allow_config_change`='batch_sise': "
                                               r"'batch_sise' is no field the restart guard "
                                               r"checks; allowed: task, model, batch_size"):
    run.run(helpers.tiny_config(allow_config_change="batch_sise"), str(tmp_path))


def test_resume_guard_fields(tmp_path):
  base = {"train_steps": 2, "steps_per_loop": 2, "checkpoint_every": 2, "mode": "train"}
  run.run(helpers.tiny_config(**base), str(tmp_path))
  for field, value in (("seed", 7), ("optimizer.name", "sgd"), ("accumulation.steps", 2)):
    with pytest.raises(errors.ConfigError, match=f"changed `{field}`"):
      run.run(helpers.tiny_config(**dict(base, train_steps=4, **{field: value})), str(tmp_path))
  # Safe changes stay free: more updates, another learning rate, two replicas.
  result = run.run(helpers.tiny_config(**dict(
      base, train_steps=4, **{"optimizer.learning_rate": 0.01, "strategy": "mirrored",
                              "cpu_replicas": 2})), str(tmp_path))
  assert result["global_step"] == 4
  # A schedule added, then dropped: the constant rate's variable made both a "changed model".
  result = run.run(helpers.tiny_config(**dict(
      base, train_steps=5, **{"optimizer.warmup_steps": 2, "optimizer.decay": "cosine"})),
                   str(tmp_path))
  assert result["global_step"] == 5
  result = run.run(helpers.tiny_config(**dict(
      base, train_steps=6, **{"optimizer.warmup_steps": 0, "optimizer.decay": "constant"})),
                   str(tmp_path))
  assert result["global_step"] == 6
  # And a meaningful change, once allowed.
  result = run.run(helpers.tiny_config(**dict(base, train_steps=8, seed=7,
                                              allow_config_change="seed")), str(tmp_path))
  assert result["global_step"] == 8
  # An evaluation reads the checkpoints: the training stream's fields are its own (they were
  # refused as "resuming with a changed `batch_size`", a probe); the model's are not.
  reading = dict(base, mode="eval", batch_size=8, seed=3, **{"accumulation.steps": 4})
  assert run.run(helpers.tiny_config(**reading), str(tmp_path))["global_step"] == 8
  with pytest.raises(errors.ConfigError, match="changed `optimizer.name`"):
    run.run(helpers.tiny_config(**dict(reading, **{"optimizer.name": "sgd"})), str(tmp_path))


def test_a_resume_with_another_constant_learning_rate_uses_it(tmp_path):
  """A constant rate was a float, which Keras keeps in a checkpointed variable: the restore put
  the old rate back over the one configured (found by the review, 2026-12-07)."""
  base = {"train_steps": 2, "steps_per_loop": 2, "checkpoint_every": 2, "mode": "train",
          "optimizer.warmup_steps": 0, "optimizer.decay": "constant"}
  run.run(helpers.tiny_config(**base), str(tmp_path))
  config = helpers.tiny_config(**dict(base, train_steps=4, **{"optimizer.learning_rate": 0.0123}))
  _, trainer = helpers.build(config, tmp_path)
  assert int(trainer.global_step.numpy()) == 2  # Restored.
  assert trainer.current_learning_rate() == pytest.approx(0.0123, rel=1e-6)


# ------------------------------------------------------------------------------ signals -------
def test_sigterm_one_second_after_start_exits_42_and_the_rerun_finishes_bitwise(tmp_path):
  solo = helpers.run_cli(tmp_path / "solo", RECIPE, "train_steps=8", *DETERMINISTIC)
  assert solo.returncode == 0, solo.stderr[-2000:]
  proc = _popen(tmp_path / "stopped", "train_steps=8", *DETERMINISTIC)
  time.sleep(1.0)
  proc.send_signal(signal.SIGTERM)
  code, err = _finish(proc, timeout=60)
  assert code == exit_codes.PREEMPTED_EXIT_CODE, err[-2000:]
  assert err.strip().splitlines()[-1].startswith("microstep: error: stopped by SIGTERM")
  rerun = helpers.run_cli(tmp_path / "stopped", RECIPE, "train_steps=8", *DETERMINISTIC)
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  helpers.assert_same_weights(tmp_path / "solo", tmp_path / "stopped")


def test_sigint_writes_a_checkpoint_and_exits_130(tmp_path):
  proc = _popen(tmp_path, "train_steps=100000", *DETERMINISTIC)
  _wait_for(proc, "train step")
  proc.send_signal(signal.SIGINT)
  code, err = _finish(proc, timeout=60)
  assert code == exit_codes.INTERRUPTED_EXIT_CODE, err[-2000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("microstep: error: stopped by SIGINT; checkpoint written at update")
  assert "KeyboardInterrupt" not in err and "Traceback" not in err
  step = int(last.split("at update ")[1].split(",")[0])
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith(f"ckpt-{step}")


def test_sigterm_while_evaluating_continuously_exits_42(tmp_path):
  trained = helpers.run_cli(tmp_path, RECIPE, "train_steps=2", *DETERMINISTIC)
  assert trained.returncode == 0, trained.stderr[-2000:]
  proc = _popen(tmp_path, "mode=continuous_eval", "eval_timeout_s=120")
  _wait_for(proc, "eval | step")
  proc.send_signal(signal.SIGTERM)
  code, err = _finish(proc, timeout=60)
  assert code == exit_codes.PREEMPTED_EXIT_CODE, err[-2000:]


def test_sigterm_during_an_evaluation_of_a_checkpointed_update_stops_at_once(tmp_path):
  """The run finished the evaluation first (a probe, 2026-12-08: exit 42 came 23 s after the
  SIGTERM; under `timeout -k 10` the run was SIGKILLed). With the update on disk there is
  nothing to save: it stops in the middle, and the rerun evaluates that update first."""
  proc = _popen(tmp_path, "task=example_tasks:SlowEvaluation", "mode=train_and_eval",
                "export_at_end=False", "train_steps=4", "steps_per_loop=2", "checkpoint_every=2",
                "eval_every=2", "eval_batch_size=4")  # 10 batches of 0.3 s: 3 s of evaluation.
  _wait_for(proc, "eval | step")
  proc.send_signal(signal.SIGTERM)
  code, err = _finish(proc, timeout=60)
  assert code == exit_codes.PREEMPTED_EXIT_CODE, err[-2000:]
  assert err.strip().splitlines()[-1] == (
      "microstep: error: stopped by SIGTERM during the evaluation of update 2, whose checkpoint "
      "is written; rerun the same command: it evaluates update 2 first")
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-2")
  assert helpers.evaluated_updates(tmp_path) == []  # Stopped before its end.


def test_a_repeated_sigterm_still_writes_the_checkpoint(tmp_path):
  proc = _popen(tmp_path, "train_steps=100000", *DETERMINISTIC)
  _wait_for(proc, "train step")
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)  # A supervisor and a VM shutdown, say.
  code, err = _finish(proc, timeout=60)
  assert code == exit_codes.PREEMPTED_EXIT_CODE, err[-2000:]
  assert "stopped by SIGTERM; checkpoint written at update" in err.strip().splitlines()[-1]


def test_a_run_over_slow_python_records_exits_when_done_and_when_stopped(tmp_path):
  """The input pipeline's destructor waits for tf.data threads inside Python code (the
  source's slow `__getitem__`), which need the GIL: at interpreter shutdown they never get it,
  and the finished or SIGTERM-stopped process hung instead of exiting 0 or 42 (a probe,
  2026-12-06). The CLI now collects the run's objects before it exits."""
  slow = ("task=example_tasks:SlowRecords", "mode=train", "export_at_end=False")
  done = helpers.run_cli(tmp_path / "done", RECIPE, *slow, "train_steps=2", "steps_per_loop=2",
                         timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  proc = _popen(tmp_path / "stopped", *slow, "train_steps=100000", "steps_per_loop=2")
  _wait_for(proc, "train step")
  proc.send_signal(signal.SIGTERM)
  code, err = _finish(proc, timeout=90)
  assert code == exit_codes.PREEMPTED_EXIT_CODE, err[-2000:]


@pytest.mark.parametrize("task", ["WithDropout", "NoiseKeptByTheTask"])
def test_dropout_masks_resume_bitwise(tmp_path, task):
  """The random layers' generator state is in the checkpoint: the masks continue, not restart.
  Also the generators a task keeps outside its model (they were left out until 2026-12-07)."""
  extra = (f"task=example_tasks:{task}", *DETERMINISTIC)
  helpers.assert_resume_is_bitwise(tmp_path, RECIPE, *extra)
  keys = tf.train.load_checkpoint(str(tmp_path / "full" / "checkpoints" / "ckpt-6")
                                  ).get_variable_to_shape_map()
  kept = sorted(k.split("/")[1] for k in keys if k.startswith("rng/task-"))
  assert kept == ([] if task == "WithDropout" else ["task-000", "task-001"]), kept


# ---------------------------------------------------------------------------- divergence ------
def test_skips_above_a_fraction_of_recent_updates_stop_the_run(tmp_path):
  config = helpers.tiny_config(**{"task": "example_tasks:Flaky", "data.shuffle": False,
                                  "train_steps": 30, "steps_per_loop": 3, "skip_window": 6,
                                  "max_skipped_fraction": 0.5, "max_consecutive_skips": 20,
                                  "mode": "train"})
  with pytest.raises(FloatingPointError, match=r"of the last \d+ updates had non-finite loss"):
    run.run(config, str(tmp_path))


def test_the_skip_window_spans_restarts(tmp_path):
  """A job restarted every 3 updates, with `skip_window`=6, never ran 6 updates in one process,
  so the fraction was never checked (until 2026-12-07). The window now starts from the run's
  start and the kept checkpoints' counts, as an uninterrupted run's would: updates 4-9 all
  skipped stop the third process at 9 (from update 0 it would be 6 of 9, under 0.7)."""
  base = {"task": "example_tasks:NanFromUpdate4", "data.shuffle": False, "steps_per_loop": 3,
          "checkpoint_every": 3, "skip_window": 6, "max_skipped_fraction": 0.7,
          "max_consecutive_skips": 20, "mode": "train"}
  for steps in (3, 6):
    assert run.run(helpers.tiny_config(train_steps=steps, **base), str(tmp_path))[
        "skipped_updates"] == steps - 3
  with pytest.raises(FloatingPointError, match=r"^6 of the last 6 updates had non-finite loss"):
    run.run(helpers.tiny_config(train_steps=9, **base), str(tmp_path))


def test_result_json_is_strict_json(tmp_path):
  assert run._strict_json({"a": float("nan"), "b": [float("inf"), 1.0]}) == {  # pylint: disable=protected-access
      "a": None, "b": [None, 1.0]}
  run.run(helpers.tiny_config(**{"train_steps": 2, "steps_per_loop": 2}), str(tmp_path))
  text = (tmp_path / "result.json").read_text()
  json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


def test_newest_checkpoint_number_tells_a_lone_ckpt_0_from_none(tmp_path):
  # Workers compare these numbers before any restore: a lone ckpt-0 (a `train_steps=0` run)
  # beside a workdir without checkpoints must not pass as the same.
  from trainer import checkpointing  # pylint: disable=g-import-not-at-top
  assert checkpointing.newest_number(str(tmp_path)) == checkpointing.NO_CHECKPOINT == -1
  (tmp_path / "ckpt-0.index").write_bytes(b"")
  assert checkpointing.newest_number(str(tmp_path)) == 0
  (tmp_path / "ckpt-12.index").write_bytes(b"")
  (tmp_path / "ckpt-3.data-00000-of-00001").write_bytes(b"")  # No index: not a checkpoint.
  assert checkpointing.newest_number(str(tmp_path)) == 12


def test_a_loop_of_skipped_updates_reports_nan_loss_not_zero(tmp_path, caplog):
  """A loop whose every update was skipped logged and wrote `loss 0.0000` (and accuracy 0):
  a diverging run looked perfect in TensorBoard (a probe, 2026-12-06). It has no mean: NaN.
  Skipped updates were only a count in the INFO line; each loop with some now warns."""
  config = helpers.tiny_config(**{"task": "example_tasks:Flaky", "data.shuffle": False,
                                  "batch_size": 16, "steps_per_loop": 1,
                                  "max_consecutive_skips": 20})
  _, trainer = helpers.build(config, tmp_path)
  losses = [float(trainer.train(tf.constant(1))["loss"]) for _ in range(4)]
  assert int(trainer.skipped_updates.numpy()) == 2  # Updates 1 and 2 (two batches in three).
  assert np.isfinite(losses[0]) and losses[0] > 0 and np.isfinite(losses[3]), losses
  assert np.isnan(losses[1]) and np.isnan(losses[2]), losses
  warned = [r.getMessage() for r in caplog.records if "were skipped" in r.getMessage()]
  assert [w.split(" (")[0] for w in warned] == [
      "1 of updates 2..2 were skipped, weights unchanged",
      "1 of updates 3..3 were skipped, weights unchanged"], warned
