"""The foundation (issue 2): replica equivalence, resume, the CLI, summaries and checkpoints."""
import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import helpers
from configs import fashion_mnist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(workdir, *overrides, timeout=300):
  """Runs the real command line in a subprocess; returns the CompletedProcess."""
  cmd = [sys.executable, "-m", "trainer.main", "--config=configs/fashion_mnist.py:smoke,synthetic",
         f"--workdir={workdir}"] + [f"--config.{o}" for o in overrides]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env,
                        check=False)


def _model_tensors(checkpoint_dir):
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(checkpoint_dir))
  names = sorted(n for n in reader.get_variable_to_shape_map() if n.startswith("weights/"))
  assert names, "the checkpoint must hold the model's variables"
  return {n: reader.get_tensor(n) for n in names}


def test_mirrored_two_replicas_equals_default(tmp_path):
  """5 updates of the real small CNN recipe: 2 logical CPU replicas vs one device."""
  results = []
  for name, overrides in (("default", {}), ("mirrored", {"strategy": "mirrored", "cpu_replicas": 2})):
    config = fashion_mnist.get_config("smoke,synthetic")
    config.update_from_flattened_dict(overrides)
    strategy, trainer = helpers.build(config, tmp_path / name)
    trainer.train(tf.constant(5))
    results.append(helpers.snapshot(strategy, trainer)[0])
  assert helpers.max_abs_diff(results[0], results[1]) <= 1e-5


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
  common = ("deterministic=True", "checkpoint_every=4", "steps_per_loop=4", "eval_every=100")
  full = _main(tmp_path / "full", "train_steps=8", *common)
  assert full.returncode == 0, full.stderr[-2000:]
  first = _main(tmp_path / "resumed", "train_steps=4", *common)
  assert first.returncode == 0, first.stderr[-2000:]
  second = _main(tmp_path / "resumed", "train_steps=8", *common)
  assert second.returncode == 0, second.stderr[-2000:]
  assert "restored" in second.stderr
  a = _model_tensors(tmp_path / "full" / "checkpoints")
  b = _model_tensors(tmp_path / "resumed" / "checkpoints")
  assert a.keys() == b.keys()
  for name in a:
    assert np.array_equal(a[name], b[name]), name
  # The data position is in the checkpoint: 8 updates of 1 micro-batch each.
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(tmp_path / "resumed" / "checkpoints"))
  assert reader.get_tensor("micro_batches_seen/.ATTRIBUTES/VARIABLE_VALUE") == 8


def test_cli_writes_config_summaries_checkpoints_and_logs(tmp_path):
  out = _main(tmp_path, "optimizer.learning_rate=0.002")
  assert out.returncode == 0, out.stderr[-2000:]
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["optimizer"]["learning_rate"] == 0.002
  assert glob.glob(str(tmp_path / "summaries" / "train" / "events.out.tfevents.*"))
  assert glob.glob(str(tmp_path / "summaries" / "eval" / "events.out.tfevents.*"))
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-12")
  lines = [l for l in out.stderr.splitlines() if "train step" in l]
  assert len(lines) == 3, out.stderr[-2000:]  # 12 updates, 4 per loop.
  for field in ("loss", "steps/s", "examples/s", "ETA"):
    assert field in lines[-1]
  result = json.loads((tmp_path / "result.json").read_text())
  assert result["global_step"] == 12 and 0.0 <= result["eval"]["accuracy"] <= 1.0


def test_tensorboard_scalars(tmp_path):
  out = _main(tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  tags = set(helpers.summary_events(tmp_path / "summaries" / "train"))
  assert {"loss", "accuracy", "learning_rate", "examples_per_second"} <= tags, tags


def test_evaluations_fall_on_multiples_of_eval_every_after_a_resume(tmp_path):
  """Orbit counts its interval from where it starts: resumed at 3 with `eval_every`=2, it
  evaluated at 5 and 7, not 4, 6 and 7."""
  from trainer import run  # pylint: disable=g-import-not-at-top
  base = {"mode": "train_and_eval", "steps_per_loop": 1, "eval_every": 2, "checkpoint_every": 1}
  run.run(helpers.tiny_config(train_steps=3, **base), str(tmp_path))
  result = run.run(helpers.tiny_config(train_steps=7, **base), str(tmp_path))
  assert set(helpers.evaluated_updates(tmp_path)) == {2, 3, 4, 6, 7}
  assert result["global_step"] == 7 and result["eval"]["examples"] == 64
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-7")
  # Resumed at the last update: nothing to train, the final weights evaluated again.
  again = run.run(helpers.tiny_config(train_steps=7, **base), str(tmp_path))
  assert again["eval"]["loss"] == pytest.approx(result["eval"]["loss"], rel=1e-6)
  # One update to go, the multiple being the end: trained, saved and evaluated once.
  last = run.run(helpers.tiny_config(train_steps=8, **base), str(tmp_path))
  assert last["global_step"] == 8 and last["eval"]["loss"] != again["eval"]["loss"]
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-8")


def test_an_evaluation_due_at_the_update_a_run_stopped_at_runs_on_resume(tmp_path):
  """A SIGTERM in the loop that reaches update 400 (`eval_every`=400) wrote ckpt-400 and exited
  42 before Orbit's evaluation; the rerun went straight on training, and the evaluation at 400
  never happened (a probe, 2026-12-07). Here the first run stops at 4 without evaluating."""
  from trainer import run  # pylint: disable=g-import-not-at-top
  base = {"steps_per_loop": 2, "eval_every": 4, "checkpoint_every": 2}
  run.run(helpers.tiny_config(train_steps=4, mode="train", **base), str(tmp_path))
  assert helpers.evaluated_updates(tmp_path) == []
  run.run(helpers.tiny_config(train_steps=8, mode="train_and_eval", **base), str(tmp_path))
  assert helpers.evaluated_updates(tmp_path) == [4, 8]


def test_a_resume_at_an_evaluated_update_does_not_evaluate_the_same_weights_again(tmp_path):
  """A run that evaluated update 4 and ended (or stopped right after that evaluation) evaluated
  4 again when resumed there: two TensorBoard points, one wasted evaluation (found 2026-12-07).
  A run retrained from update 0 into the same workdir has other weights at 4: evaluated."""
  from trainer import run  # pylint: disable=g-import-not-at-top
  base = {"mode": "train_and_eval", "steps_per_loop": 2, "eval_every": 4, "checkpoint_every": 2}
  extended, retrained = tmp_path / "extended", tmp_path / "retrained"
  for workdir in (extended, retrained):
    run.run(helpers.tiny_config(train_steps=4, **base), str(workdir))
    assert helpers.evaluated_updates(workdir) == [4]
  result = run.run(helpers.tiny_config(train_steps=8, **base), str(extended))
  assert helpers.evaluated_updates(extended) == [4, 8] and result["global_step"] == 8
  # Other weights at update 4 (checkpoints deleted, another seed): evaluated on resume.
  shutil.rmtree(retrained / "checkpoints")
  run.run(helpers.tiny_config(train_steps=4, seed=7, **dict(base, mode="train")), str(retrained))
  run.run(helpers.tiny_config(train_steps=8, seed=7, **base), str(retrained))
  assert helpers.evaluated_updates(retrained) == [4, 4, 8]


def test_the_weights_digest_reads_each_buffer_as_earlier_versions_hashed_its_bytes():
  """`evaluated.json` files written before 2026-12-08 hashed `tobytes()` copies; the digest now
  reads the buffers in place and must name the same weights: scalars, bfloat16, ints, bools."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  from trainer import evaluated  # pylint: disable=g-import-not-at-top
  layer = keras.layers.Layer()
  rng = np.random.RandomState(0)
  for shape, dtype in [((), "float32"), ((3, 4), "bfloat16"), ((5,), "int64"), ((2, 2), "bool"),
                       ((2, 3, 4), "float16")]:
    layer.add_weight(shape=shape, dtype=dtype, trainable=False,
                     initializer=keras.initializers.Constant(rng.normal(size=shape)))
  layer.weights[1].assign(tf.transpose(tf.reshape(tf.range(12, dtype=tf.bfloat16), (4, 3))))
  before = hashlib.sha256()
  for weight in layer.weights:
    value = np.asarray(weight.numpy())
    before.update(f"{value.dtype.str}{value.shape}".encode())
    before.update(np.ascontiguousarray(value).tobytes())
  assert evaluated.weights_digest(layer) == before.hexdigest()
  layer.weights[0].assign(1.5)
  assert evaluated.weights_digest(layer) != before.hexdigest()


@pytest.mark.parametrize("override,message", [
    ("strategy=ring", "`strategy`='ring' unknown; allowed: default, one_device, mirrored"),
    ("batch_size=15", "`batch_size`=15 is not divisible by the 2 replicas"),
    ("data.source=idx", "`data.dir`="),
    ("batch_size=abc", "batch_size"),
])
def test_bad_input_fails_early_with_one_line(tmp_path, override, message):
  extra = ["strategy=mirrored", "cpu_replicas=2"] if "batch_size=15" in override else []
  if override == "data.source=idx":
    extra = [f"data.dir={tmp_path / 'nowhere'}"]
  out = _main(tmp_path / "w", override, *extra, timeout=120)
  assert out.returncode == 2
  assert message in out.stderr, out.stderr[-1500:]
  if override == "data.source=idx":
    assert "apt-get install dataset-fashion-mnist" in out.stderr
  errors = [l for l in out.stderr.splitlines() if l.startswith("microstep: error:")]
  assert len(errors) == 1 and "Traceback" not in out.stderr


def test_eval_and_continuous_eval_modes_read_the_checkpoints(tmp_path):
  from trainer import run  # pylint: disable=g-import-not-at-top
  trained = run.run(helpers.tiny_config(**{"mode": "train", "train_steps": 4,
                                           "checkpoint_every": 2, "steps_per_loop": 2}),
                    str(tmp_path))
  assert trained["global_step"] == 4 and "eval" not in trained
  evaluated = run.run(helpers.tiny_config(mode="eval"), str(tmp_path))
  assert evaluated["global_step"] == 4, "eval restores the latest checkpoint"
  assert evaluated["eval"]["examples"] == 64.0  # The whole synthetic test split, once.
  continuous = run.run(helpers.tiny_config(mode="continuous_eval", eval_timeout_s=1),
                       str(tmp_path))
  assert continuous["eval"]["accuracy"] == pytest.approx(evaluated["eval"]["accuracy"])
