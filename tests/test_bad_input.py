"""Bad configs and bad data: each fails before any compute with one line, losing no checkpoint.

The table below is the one in docs/robustness.md. Cases run in-process through `run.run` against
a workdir that already holds a good checkpoint; after each case that checkpoint is still the
latest and still restores.
"""
import gzip
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import helpers
from trainer import errors
from trainer import run
from trainer import validation
from trainer.tasks import fashion_mnist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _idx(path, array):
  dims = array.shape
  header = bytes([0, 0, 8, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims)
  with gzip.open(path, "wb") as f:
    f.write(header + array.astype(np.uint8).tobytes())


def _fake_data_dir(root, images=(64, 28, 28), labels=None, truncate=False, damage=None):
  """IDX files like the Debian package's; `damage` breaks the train images file on disk:
  'cut_gzip' (the gzip stream ends early), 'random_bytes' (not gzip), 'directory' (a directory
  where the file belongs)."""
  os.makedirs(root, exist_ok=True)
  rng = np.random.RandomState(0)
  for split, (image_name, label_name) in fashion_mnist._IDX_FILES.items():  # pylint: disable=protected-access
    x = rng.randint(0, 255, images)
    y = rng.randint(0, 10, images[0]) if labels is None else np.full(images[0], labels)
    _idx(os.path.join(root, image_name), x)
    _idx(os.path.join(root, label_name), y)
    if truncate:
      path = os.path.join(root, image_name)
      raw = gzip.open(path).read()
      with gzip.open(path, "wb") as f:
        f.write(raw[: len(raw) // 2])
  path = os.path.join(root, fashion_mnist._IDX_FILES["train"][0])  # pylint: disable=protected-access
  if damage == "cut_gzip":
    raw = open(path, "rb").read()
    open(path, "wb").write(raw[: len(raw) // 2])
  elif damage == "random_bytes":
    open(path, "wb").write(np.random.RandomState(1).bytes(4096))
  elif damage == "directory":
    os.remove(path)
    os.makedirs(path)
  return str(root)


# (case id, config overrides, data-dir maker or None, expected text in the one-line message)
CASES = [
    ("unknown strategy", {"strategy": "ring"}, None, "`strategy`='ring' unknown; allowed"),
    ("batch not divisible", {"strategy": "mirrored", "cpu_replicas": 2, "batch_size": 15}, None,
     "`batch_size`=15 is not divisible by the 2 replicas"),
    ("eval batch not divisible", {"strategy": "mirrored", "cpu_replicas": 2,
                                  "eval_batch_size": 33}, None, "`eval_batch_size`=33"),
    ("k = 0", {"accumulation.steps": 0}, None, "`accumulation.steps`=0 must be an integer >= 1"),
    ("unknown optimizer", {"optimizer.name": "lamb"}, None, "`optimizer.name`='lamb' unknown"),
    ("negative learning rate", {"optimizer.learning_rate": -1.0}, None,
     "`optimizer.learning_rate`=-1.0 must be a number > 0"),
    ("momentum >= 1", {"optimizer.momentum": 1.5}, None, "`optimizer.momentum`=1.5 must be in [0, 1)"),
    # Adam and AdamW ignored them without a word (a probe, 2026-12-07).
    ("momentum with adam", {"optimizer.name": "adam", "optimizer.momentum": 0.9}, None,
     "`optimizer.momentum`=0.9 applies to `optimizer.name`=sgd only; with adam, "
     "`optimizer.beta_1` plays its part (allowed: 0.0, or `optimizer.name`=sgd)"),
    ("nesterov with adamw", {"optimizer.name": "adamw", "optimizer.nesterov": True}, None,
     "`optimizer.nesterov`=True applies to `optimizer.name`=sgd only"),
    # Keras' seeding raised a traceback (a probe, 2026-12-07).
    ("seed beyond 32 bits", {"seed": 2**32}, None,
     "`seed`=4294967296 is too large; allowed: 0 to 4294967295"),
    ("negative clip norm", {"optimizer.global_clipnorm": -1.0}, None,
     "`optimizer.global_clipnorm`=-1.0 must be a number >= 0"),
    ("unknown decay", {"optimizer.decay": "step"}, None, "`optimizer.decay`='step' unknown"),
    ("unknown mode", {"mode": "predict"}, None, "`mode`='predict' unknown"),
    ("unknown precision", {"mixed_precision": "float8"}, None, "`mixed_precision`='float8' unknown"),
    ("unknown task", {"task": "segmentation"}, None, "`task`='segmentation' unknown"),
    ("unknown model", {"model": "resnet"}, None, "`model`='resnet' unknown"),
    ("unknown data source", {"data.source": "csv"}, None, "`data.source`='csv' unknown"),
    ("cpu_replicas without mirrored", {"cpu_replicas": 2}, None, "needs `strategy`=mirrored"),
    ("tpu without address", {"strategy": "tpu"}, None, "`tpu_address` is empty"),
    ("zero batch", {"batch_size": 0}, None, "`batch_size`=0 must be an integer >= 1"),
    ("negative train steps", {"train_steps": -5}, None, "`train_steps`=-5 must be an integer >= 1"),
    ("zero steps per loop", {"steps_per_loop": 0}, None, "`steps_per_loop`=0"),
    ("unknown batchnorm policy", {"accumulation.batchnorm": "ignore"}, None,
     "`accumulation.batchnorm`='ignore' unknown"),
    ("VGG image size", {"model": "vgg_small", "data.image_size": 30}, None,
     "`data.image_size`=30 must be a multiple of 32"),
    ("missing data dir", {"data.source": "idx", "data.dir": "/nonexistent/fmnist"}, None,
     "apt-get install dataset-fashion-mnist"),
    ("wrong image shape", {"data.source": "idx"}, lambda d: _fake_data_dir(d, images=(64, 32, 32)),
     "train images have shape (64, 32, 32); expected [N, 28, 28]"),
    ("labels out of range", {"data.source": "idx"}, lambda d: _fake_data_dir(d, labels=12),
     "train labels span [12, 12]; allowed: 0..9"),
    ("empty dataset", {"data.source": "idx"}, lambda d: _fake_data_dir(d, images=(0, 28, 28)),
     "train split is empty"),
    ("truncated file", {"data.source": "idx"}, lambda d: _fake_data_dir(d, truncate=True),
     "is truncated"),
    ("gzip stream cut short", {"data.source": "idx"},
     lambda d: _fake_data_dir(d, damage="cut_gzip"), "is not a readable gzip file (EOFError"),
    ("random bytes instead of gzip", {"data.source": "idx"},
     lambda d: _fake_data_dir(d, damage="random_bytes"), "is not a readable gzip file"),
    ("a directory instead of a file", {"data.source": "idx"},
     lambda d: _fake_data_dir(d, damage="directory"), "lacks the file train-images-idx3-ubyte.gz"),
    # Every number finite and in range (issue 11).
    ("learning rate NaN", {"optimizer.learning_rate": float("nan")}, None,
     "`optimizer.learning_rate`=nan must be a finite number"),
    ("learning rate inf", {"optimizer.learning_rate": float("inf")}, None,
     "`optimizer.learning_rate`=inf must be a finite number"),
    ("beta_1 NaN", {"optimizer.beta_1": float("nan")}, None,
     "`optimizer.beta_1`=nan must be a finite number"),
    ("beta_2 = 1", {"optimizer.beta_2": 1.0}, None, "`optimizer.beta_2`=1.0 must be in [0, 1)"),
    ("epsilon = 0", {"optimizer.epsilon": 0.0}, None, "`optimizer.epsilon`=0.0 must be a number > 0"),
    ("weight decay inf", {"optimizer.weight_decay": float("inf")}, None,
     "`optimizer.weight_decay`=inf must be a finite number"),
    ("clip norm NaN", {"optimizer.global_clipnorm": float("nan")}, None,
     "`optimizer.global_clipnorm`=nan must be a finite number"),
    ("negative warm-up", {"optimizer.warmup_steps": -1}, None,
     "`optimizer.warmup_steps`=-1 must be an integer >= 0"),
    ("loss scale inf", {"loss_scale.initial": float("inf")}, None,
     "`loss_scale.initial`=inf must be a finite number"),
    ("margin NaN", {"triplet.margin": float("nan")}, None, "`triplet.margin`=nan must be a finite"),
    ("peer timeout 0", {"peer_timeout_s": 0}, None, "`peer_timeout_s`=0 must be a number > 0"),
    ("eval timeout negative", {"eval_timeout_s": -1}, None, "`eval_timeout_s`=-1 must be a number"),
    ("skip fraction 0", {"max_skipped_fraction": 0.0}, None,
     "`max_skipped_fraction`=0.0 must be a number > 0"),
    ("skip fraction above 1", {"max_skipped_fraction": 1.5}, None,
     "`max_skipped_fraction`=1.5 must be in (0, 1]"),
    ("skip window 0", {"skip_window": 0}, None, "`skip_window`=0 must be an integer >= 1"),
    ("keep 0 checkpoints", {"keep_checkpoints": 0}, None, "`keep_checkpoints`=0 must be an integer"),
    ("eval steps 0", {"eval_steps": 0}, None,
     "`eval_steps`=0 must be -1 (the whole split) or an integer >= 1"),
    ("unknown xla setting", {"xla": "maybe"}, None, "`xla`='maybe' unknown; allowed: auto, on, off"),
    ("unknown replica_state", {"replica_state": "avg"}, None, "`replica_state`='avg' unknown"),
    ("unknown data.resume", {"data.resume": "never"}, None, "`data.resume`='never' unknown"),
    ("image too small for the CNN", {"model": "small_cnn", "data.image_size": 8}, None,
     "`data.image_size`=8 is too small for `model`=small_cnn; allowed: >= 10"),
    ("per-example statistics on triplets", {"task": "triplet", "model": "vgg_small",
                                            "data.image_size": 32, "per_example.every_steps": 1},
     None, "`per_example.every_steps` needs one model row per example"),
    ("one_device on a device that does not exist", {"strategy": "one_device", "device": "bogus"},
     None, "`device`='bogus' is not a device of this machine; allowed: /cpu:0"),
    ("one_device on a GPU this machine lacks", {"strategy": "one_device", "device": "/gpu:7"},
     None, "`device`='/gpu:7' is not a device of this machine"),
    ("strategy=tpu without a TPU", {"strategy": "tpu", "tpu_address": "local"}, None,
     "`strategy`=tpu: no TPU at `tpu_address`='local'"),
    ("text task: target token outside the vocabulary", {"task": "text_classification",
                                                         "text.target_token": 5000}, None,
     "`text.target_token`=5000 must be in 1..999"),
    ("histogram task without features", {"task": "histogram_chi_square",
                                         "histogram.features": 0}, None,
     "`histogram.features`=0 must be an integer >= 1"),  # oneDNN aborted the process (SIGABRT).
    ("histogram task, negative examples", {"task": "histogram_chi_square",
                                           "histogram.train_examples": -1}, None,
     "`histogram.train_examples`=-1 must be an integer >= 1"),
    ("npz task without a file", {"task": "npz_classification"}, None, "`data.path` is empty"),
    ("npz task, file missing", {"task": "npz_classification", "data.path": "/nonexistent.npz"},
     None, "`data.path`='/nonexistent.npz' is not a file"),
]


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("good")
  run.run(helpers.tiny_config(), str(workdir))
  latest = tf.train.latest_checkpoint(str(workdir / "checkpoints"))
  assert latest
  return workdir, latest


@pytest.mark.parametrize("case,overrides,make_data,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_table(trained_workdir, tmp_path, case, overrides, make_data, message):
  del case
  workdir, latest = trained_workdir
  if make_data:
    overrides = dict(overrides, **{"data.dir": make_data(tmp_path / "data")})
  fashion_mnist._cached_arrays.cache_clear()  # pylint: disable=protected-access
  config = helpers.tiny_config(**overrides)
  with pytest.raises((errors.ConfigError, errors.DataError)) as error:
    run.run(config, str(workdir))
  text = str(error.value)
  assert message in text
  assert "\n" not in text
  assert tf.train.latest_checkpoint(str(workdir / "checkpoints")) == latest
  tf.train.load_checkpoint(latest)  # Still readable.


def test_a_bad_field_leaves_no_workdir_and_no_lock(tmp_path):
  """Every table case that `validation.validate` rejects fails before the workdir is touched:
  a mistyped override neither creates a new workdir nor leaves a lock in an existing one."""
  rejected = 0
  for case, overrides, make_data, message in CASES:
    if make_data:
      continue
    config = helpers.tiny_config(**overrides)
    try:
      validation.validate(config)
    except errors.ConfigError:
      rejected += 1
    else:
      continue
    fresh, existing = tmp_path / f"new_{rejected}", tmp_path / f"old_{rejected}"
    existing.mkdir()
    for workdir in (fresh, existing):
      with pytest.raises(errors.ConfigError) as error:
        run.run(config, str(workdir))
      assert message in str(error.value), case
    assert not fresh.exists(), case
    assert not os.listdir(existing), (case, os.listdir(existing))
  assert rejected >= 30, rejected  # The table's config cases, not a vacuous loop.


def test_nan_inputs_refused():
  images = np.zeros((4, 28, 28), np.float32)
  images[1, 3, 3] = np.nan
  with pytest.raises(errors.DataError, match="NaN or Inf"):
    fashion_mnist.check_arrays(images, np.zeros(4, np.int64), "train")


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(validation.ConfigError, match="`--workdir`=.* is not writable"):
    run.run(helpers.tiny_config(), str(blocker / "sub"))
  # The file itself as the workdir: it said "is not writable: File exists" (a probe, 2026-12-07).
  with pytest.raises(validation.ConfigError, match=r"^`--workdir`=.*/file' is a file, not a "
                     r"directory; name a directory \(it is made if missing\)$"):
    run.run(helpers.tiny_config(), str(blocker))


def test_divergence_stops_with_a_clear_error(tmp_path):
  """Non-finite updates are skipped and counted; after `max_consecutive_skips` the run stops."""
  config = helpers.tiny_config(**{"optimizer.name": "sgd", "optimizer.learning_rate": 1e30,
                                  "train_steps": 40, "steps_per_loop": 5,
                                  "max_consecutive_skips": 5, "checkpoint_every": 5})
  with pytest.raises(FloatingPointError, match="consecutive updates had non-finite"):
    run.run(config, str(tmp_path))
  latest = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
  assert latest is not None


def test_cli_exit_codes(tmp_path):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  base = [sys.executable, "-m", "trainer.main", "--config=configs/fashion_mnist.py:smoke,synthetic",
          f"--workdir={tmp_path}"]
  bad = subprocess.run(base + ["--config.accumulation.steps=0"], cwd=REPO, capture_output=True,
                       text=True, env=env, timeout=120, check=False)
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1].startswith("microstep: error: `accumulation.steps`=0")
  diverge = subprocess.run(base + ["--config.optimizer.name=sgd", "--config.optimizer.learning_rate=1e30",
                                   "--config.max_consecutive_skips=3", "--config.train_steps=40"],
                           cwd=REPO, capture_output=True, text=True, env=env, timeout=120, check=False)
  assert diverge.returncode == 3, diverge.stderr[-1500:]
  shutil.rmtree(tmp_path, ignore_errors=True)


def test_restoring_a_checkpoint_of_another_model_is_one_line(trained_workdir):
  workdir, latest = trained_workdir
  config = helpers.tiny_config(model="small_cnn")
  # The resume guard names the changed field before anything is restored...
  with pytest.raises(validation.ConfigError, match=r"changed `model` \('mlp' -> 'small_cnn'\)"):
    run.run(config, str(workdir))
  # ...and when the user waives it, the restore itself still refuses in one line.
  config.allow_config_change = "model"
  with pytest.raises(validation.ConfigError, match="does not match this config"):
    run.run(config, str(workdir))
  assert tf.train.latest_checkpoint(str(workdir / "checkpoints")) == latest


def test_per_replica_batch_larger_than_the_data_is_refused(tmp_path):
  config = helpers.tiny_config(**{"batch_size": 1024})  # 512 synthetic training examples.
  with pytest.raises(validation.ConfigError, match="`batch_size`=1024 gives each replica more"):
    run.run(config, str(tmp_path))
