"""Bring your own model, data and loss (issue 9): the public Task API end to end.

Tasks live in tests/example_tasks.py, written the way a user writes them, and are selected by
import path. CLI runs go through `helpers.run_cli` (a subprocess under `timeout -k`).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import example_tasks
import helpers
from trainer import base_task
from trainer import data
from trainer import errors
from trainer import run
from trainer import sources

FAST = ("train_steps=6", "steps_per_loop=2", "checkpoint_every=2", "eval_every=6",
        "deterministic=True", "export_at_end=False")


# ------------------------------------------------------------------------- data sources -------
def test_every_random_access_source_gives_the_same_batches(tmp_path):
  arrays = example_tasks._arrays(40, 1)  # pylint: disable=protected-access
  np.savez(tmp_path / "mine.npz", **arrays)
  records = [{k: v[i] for k, v in arrays.items()} for i in range(40)]
  kinds = {"dict": arrays, "npz": str(tmp_path / "mine.npz"), "indexable": records,
           "example_source": sources.arrays_source(arrays)}
  positions = tf.range(30, 60, dtype=tf.int64)  # Spans the end of epoch 0 and epoch 1.
  batches = {name: data.batch_at(sources.as_source(s, name), positions, seed=5, shuffle=True)
             for name, s in kinds.items()}
  for name, batch in batches.items():
    assert set(batch) == {"x", "y", sources.VALID_KEY}, name
    for key in ("x", "y"):
      np.testing.assert_array_equal(batch[key], batches["dict"][key], err_msg=name)
  epoch1 = np.asarray(batches["dict"]["y"][10:])  # Positions 40..59: a permutation of epoch 1.
  assert len(epoch1) == 20


def test_a_pandas_dataframe_is_the_dict_of_its_columns():
  """A DataFrame has __len__ and __getitem__, but df[0] is a column: read as records, it failed
  with `KeyError: 0` in the data pipeline's Python."""
  import pandas as pd  # pylint: disable=g-import-not-at-top  (installed with tf-models-official)
  rng = np.random.RandomState(0)
  columns = {"size": rng.normal(size=30).astype(np.float32), "y": rng.randint(0, 2, 30),
             "word": np.array(["cat", "dog", "horse"])[rng.randint(0, 3, 30)]}
  positions = tf.range(0, 45, dtype=tf.int64)
  got = data.batch_at(sources.as_source(pd.DataFrame(columns), "frame"), positions, seed=3,
                      shuffle=True)
  want = data.batch_at(sources.as_source(columns, "dict"), positions, seed=3, shuffle=True)
  assert set(got) == set(want) == {"size", "y", "word", sources.VALID_KEY}
  for key in columns:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_indexable_records_keep_strings_longer_than_record_0s():
  """They were cut to record 0's length ('horse' -> 'hor')."""
  words = ["cat", "horse", "hippopotamus", "ox"]
  records = [{"word": np.array(w), "n": np.int64(i)} for i, w in enumerate(words)]
  batch = data.batch_at(sources.as_source(records, "train_data()"), tf.range(4, dtype=tf.int64),
                        seed=0, shuffle=False)
  assert [w.decode() for w in batch["word"].numpy()] == words
  np.testing.assert_array_equal(batch["n"], [0, 1, 2, 3])


@pytest.mark.parametrize("bad,message", [
    ({"x": np.zeros((3, 2)), "y": np.zeros(4)}, "must share one leading dimension"),
    ({"x": np.array([[np.nan]])}, "contains NaN or Inf"),
    ({}, "empty dict"),
    (tf.data.Dataset.range(3), "return a function that builds it"),
    (42, "allowed: dict of arrays, .npz path"),
    ("/nonexistent/file.npz", "is not a file"),
    ([(1, 2)], "records must be dicts"),
])
def test_bad_sources_are_one_line(bad, message):
  with pytest.raises(errors.DataError, match=message) as error:
    sources.as_source(bad, "train_data()")
  assert "\n" not in str(error.value)


def test_an_npz_of_several_splits_is_one_line(tmp_path):
  """keras.datasets' layout (x_train, y_train, x_test, y_test) read as ONE split failed on the
  unequal lengths, while a docstring promised the split names worked."""
  arrays = example_tasks._arrays(40, 1)  # pylint: disable=protected-access
  np.savez(tmp_path / "mnist.npz", x_train=arrays["x"], y_train=arrays["y"],
           x_test=arrays["x"][:8], y_test=arrays["y"][:8])
  with pytest.raises(errors.DataError, match=r"^train_data\(\)='.*mnist.npz' holds 2 splits "
                     r"\(test, train\); return a dict of one split's arrays"):
    sources.as_source(str(tmp_path / "mnist.npz"), "train_data()")


def test_tf_data_eval_pads_and_covers_every_example_once():
  factory = sources.DatasetFactory(lambda: tf.data.Dataset.from_tensor_slices(
      {"x": tf.range(10, dtype=tf.float32)}))
  ctx = tf.distribute.InputContext(num_replicas_in_sync=2)
  batches = list(data.factory_eval_stream(ctx, factory, global_batch=8))
  assert len(batches) % 2 == 0, "every local replica gets a batch at every step"
  valid = np.concatenate([b[sources.VALID_KEY].numpy() for b in batches])
  xs = np.concatenate([b["x"].numpy() for b in batches])
  assert valid.sum() == 10 and sorted(xs[valid == 1]) == list(range(10))


# --------------------------------------------------------------------------- the tasks --------
def test_task_from_outside_the_package_trains_through_the_cli(tmp_path):
  outside = tmp_path / "project"
  outside.mkdir()
  (outside / "my_pkg_task.py").write_text(
      "from example_tasks import NoMetrics\n\nclass Mine(NoMetrics):\n  pass\n")
  out = helpers.run_cli(tmp_path / "w", "configs/fashion_mnist.py:smoke",
                        "task=my_pkg_task:Mine", "train_steps=4", cwd=outside)
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads((tmp_path / "w" / "result.json").read_text())
  assert result["global_step"] == 4 and "loss" in result["eval"]
  assert "accuracy" not in result["eval"], "no metrics: only the loss and the example count"
  assert "train step 4/4 | loss" in out.stderr


def test_a_task_with_no_metrics_trains_evaluates_and_logs(tmp_path):
  config = helpers.tiny_config(**{"task": "example_tasks:NoMetrics", "train_steps": 4,
                                  "steps_per_loop": 2, "eval_every": 4})
  result = run.run(config, str(tmp_path))
  assert result["global_step"] == 4
  assert result["eval"]["examples"] == 40.0


class _EvalWithoutLabels(example_tasks.NoMetrics):
  """Evaluation data without the `y` its loss reads; `teacher` is read in training only."""

  def train_data(self):
    arrays = super().train_data()
    return dict(arrays, teacher=np.zeros(len(arrays["y"]), np.float32))

  def eval_data(self):
    return {"x": super().eval_data()["x"]} if self.config.drop_labels else super().eval_data()

  def per_example_loss(self, model, batch, training):
    loss = example_tasks._xent(model, batch, training)[0]  # pylint: disable=protected-access
    return base_task.LossOutput(loss=loss + batch["teacher"] if training else loss)


@pytest.mark.parametrize("drop_labels", [True, False])
def test_evaluation_data_lacking_a_field_the_loss_reads_fails_before_training(tmp_path,
                                                                              drop_labels):
  config = helpers.tiny_config(**{"train_steps": 2, "steps_per_loop": 2, "eval_every": 2})
  config.drop_labels = drop_labels
  if drop_labels:  # It was a KeyError traceback at the first evaluation, after training.
    with pytest.raises(errors.DataError, match=r"^eval_data\(\) has no field 'y', which "
                       r"_EvalWithoutLabels reads in evaluation; its fields: x; train_data\(\) "
                       r"also has teacher, y$"):
      run.run(config, str(tmp_path), task=_EvalWithoutLabels(config))
    assert not os.path.exists(tmp_path / "checkpoints" / "checkpoint"), "nothing trained"
  else:  # Missing `teacher`, read only in training, is fine.
    assert run.run(config, str(tmp_path), task=_EvalWithoutLabels(config))["global_step"] == 2


def test_trainer_train_takes_a_task_instance(tmp_path):
  import trainer  # pylint: disable=g-import-not-at-top
  config = helpers.tiny_config(**{"train_steps": 2, "steps_per_loop": 2, "eval_every": 2})
  result = trainer.train(config, str(tmp_path), task=example_tasks.NoMetrics(config))
  assert result["global_step"] == 2


@pytest.mark.parametrize("task,code,message", [
    ("example_tasks:BadLoss", 2, "loss has shape (32, 1); expected one value per example"),
    ("example_tasks:BadData", 2, "my_records.tfrecord: field `label` has 11 classes"),
    ("example_tasks:Missing", 2, "module 'example_tasks' has no 'Missing'"),
    ("no_such_module:Task", 2, "cannot import 'no_such_module'"),
    ("nonsense", 2, "`task`='nonsense' unknown; allowed: classification, triplet"),
    ("example_tasks:LabelsOutOfRange", 2, "TensorFlow rejected a batch at per_example_loss/"
     "SparseSoftmaxCrossEntropyWithLogits/SparseSoftmaxCrossEntropyWithLogits: Received a label "
     "value of 5 which is outside the valid range of [0, 2)."),
    ("example_tasks:MaskedLoss", 2, "MaskedLoss.per_example_loss: loss has another number of "
     "values than the batch has examples; expected one per example [B]"),
    ("example_tasks:IdsOutOfVocabulary", 2, "embedding_1/GatherV2: indices[1,0] = 51 is not in "
     "[0, 50) (the data's values do not fit the model or the loss"),
])
def test_task_errors_are_one_line_with_exit_2(tmp_path, task, code, message):
  out = helpers.run_cli(tmp_path, "configs/fashion_mnist.py:smoke", f"task={task}", timeout=120)
  assert out.returncode == code, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("microstep: error:") and message in last, last
  assert "Traceback" not in out.stderr


@pytest.mark.parametrize("source,message", [
    ("def broken(:\n  pass\n", r"raised SyntaxError: invalid syntax \(\S+broken_task\.py, line 1\)"),
    ("import os\n\nraise RuntimeError('no GPU quota left')\n",
     r"raised RuntimeError: no GPU quota left \(\S+broken_task\.py, line 3\)"),
    # Raised inside a library: the module's own line that called it.
    ("import numpy as np\n\nVOCAB = np.load('/nonexistent/vocab.npy')\n",
     r"raised FileNotFoundError: \[Errno 2\] No such file or directory: '/nonexistent/vocab\.npy' "
     r"\(\S+broken_task\.py, line 3\)"),
])
def test_a_task_module_that_fails_to_import_is_one_line(tmp_path, source, message):
  # A SyntaxError or the module's own exception was a 40-line traceback, exit 1 (a missing
  # dependency was already one line; a probe, 2026-12-08).
  (tmp_path / "broken_task.py").write_text(source)
  out = helpers.run_cli(tmp_path / "w", "configs/fashion_mnist.py:smoke", "task=broken_task:Task",
                        timeout=120, extra_env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{helpers.REPO}"})
  assert out.returncode == 2, out.stderr[-2000:]
  assert re.match(r"^microstep: error: `task`='broken_task:Task': importing 'broken_task' "
                  + message + r" \(--traceback prints where\)$",
                  out.stderr.strip().splitlines()[-1]), out.stderr[-2000:]
  assert "Traceback" not in out.stderr


def test_an_error_in_the_task_s_own_code_is_one_line_and_its_traceback_a_flag_away(tmp_path):
  """Keras' ValueError inside the task's loss: one line naming the task's file and line, which
  says that `--traceback` prints where it came from; with the flag, TensorFlow's listing of the
  task's frames comes first (there was no way to see it, 2026-12-07)."""
  args = ("configs/fashion_mnist.py:smoke", "task=example_tasks:OneHotOfAnotherWidth")
  line = (r"^microstep: error: the task's per_example_loss fails \(example_tasks\.py:\d+\): "
          r"ValueError: Arguments `target` and `output` must have the same shape\. Received: "
          r"target\.shape=\(32, 3\), output\.shape=\(32, 2\)")
  plain = helpers.run_cli(tmp_path / "plain", *args, timeout=120)
  assert plain.returncode == 2, plain.stderr[-2000:]
  assert re.match(line + r" \(--traceback prints where\)$", plain.stderr.strip().splitlines()[-1])
  assert "Traceback" not in plain.stderr
  shown = helpers.run_cli(tmp_path / "shown", *args, timeout=120, flags=["--traceback"])
  assert shown.returncode == 2, shown.stderr[-2000:]
  assert re.match(line + "$", shown.stderr.strip().splitlines()[-1]), shown.stderr[-2000:]
  listing = shown.stderr[shown.stderr.index("Traceback (most recent call last)"):]
  assert re.search(r'example_tasks\.py", line \d+, in per_example_loss', listing), listing[-3000:]


@pytest.mark.parametrize("task,message", [
    ("example_tasks:BadLoss", "loss has shape (16, 1); expected one value per example"),
    ("example_tasks:MaskedLoss", "MaskedLoss.per_example_loss: loss has another number of values "
     "than the batch has examples"),
    ("example_tasks:LabelsOutOfRange", "Received a label value of 5 which is outside the valid "
     "range of [0, 2)."),
])
def test_task_errors_under_two_replicas_are_the_same_one_line(tmp_path, task, message):
  # Two replicas failing in one step: TF reports each as a root error (the line used to be
  # "... 0 derived errors ignored", sent as a data error); an error raised while tracing a
  # replica's function was logged with its traceback by TF's coordinator before the line.
  out = helpers.run_cli(tmp_path, "configs/fashion_mnist.py:smoke", f"task={task}",
                        "strategy=mirrored", "cpu_replicas=2", timeout=120)
  assert out.returncode == 2, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("microstep: error:") and message in last, last
  assert "derived errors" not in last
  assert "Traceback" not in out.stderr and "Coordinator" not in out.stderr, out.stderr[-3000:]


# ------------------------------------------------------------------ exactness, Transformer ----
def test_transformer_accumulation_equals_the_big_batch(tmp_path):
  """Text task, k=4 under Mirrored(2), AdamW + clipping + warm-up: equals one big step, 1e-6."""
  config = helpers.tiny_config(**{
      "task": "text_classification", "text.train_examples": 256, "text.test_examples": 32,
      "batch_size": 16, "accumulation.steps": 4, "strategy": "mirrored", "cpu_replicas": 2,
      "optimizer.name": "adamw", "optimizer.weight_decay": 0.05, "optimizer.learning_rate": 0.01,
      "optimizer.global_clipnorm": 0.3, "optimizer.warmup_steps": 2, "optimizer.decay": "cosine",
      "train_steps": 3})
  strategy, trainer = helpers.build(config, tmp_path)
  initial, _ = helpers.snapshot(strategy, trainer)
  trainer.train(tf.constant(3))
  weights, slots = helpers.snapshot(strategy, trainer)
  assert float(trainer.last_grad_norm.numpy()) > 0.3, "clipping must be active"
  ref_weights, ref_slots = helpers.reference_run(config, initial,
                                                 helpers.update_batches(config, 3))
  assert helpers.max_abs_diff(weights, ref_weights) <= 1e-6
  assert helpers.max_abs_diff(slots, ref_slots) <= 1e-6


# --------------------------------------------------------------------- resume, tf.data -------
@pytest.mark.parametrize("strategy,crash,how", [
    ("default", "before_write:10", "restored the input iterator of update 8"),
    ("mirrored", "before_write:10", "restored the input iterator of update 8"),
    ("default", "data_state:8", "skipping the 16 micro-batches"),
])
def test_tf_data_task_resumes_bitwise_after_kill_9(tmp_path, strategy, crash, how):
  """kill -9 inside a checkpoint save, rerun: the same weights as a run never interrupted."""
  extra = ["task=example_tasks:Streamed", "accumulation.steps=2", "train_steps=16",
           "steps_per_loop=2", "checkpoint_every=2", "eval_every=16", "deterministic=True",
           "export_at_end=False", "mode=train"]
  if strategy == "mirrored":
    extra += ["strategy=mirrored", "cpu_replicas=2"]
  full = helpers.run_cli(tmp_path / "full", "configs/fashion_mnist.py:smoke", *extra)
  assert full.returncode == 0, full.stderr[-2000:]
  killed = tmp_path / "killed"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=os.pathsep.join([helpers.REPO, helpers.TESTS]))
  crashed = subprocess.run(
      ["timeout", "-k", "5", "240", sys.executable, os.path.join(helpers.TESTS, "crash_worker.py"),
       crash, f"--config={os.path.join(helpers.REPO, 'configs/fashion_mnist.py')}:smoke",
       f"--workdir={killed}"] + [f"--config.{e}" for e in extra],
      cwd=helpers.REPO, env=env, capture_output=True, text=True, timeout=260, check=False)
  assert crashed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), crashed.stderr[-2000:]
  resumed = helpers.run_cli(killed, "configs/fashion_mnist.py:smoke", *extra)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert how in resumed.stderr, resumed.stderr[-3000:]
  assert "could not be found in the restored object" not in resumed.stderr  # Its `update`.
  helpers.assert_same_weights(tmp_path / "full", killed)


def test_tf_data_resume_with_another_replica_count_skips_with_a_warning(tmp_path):
  extra = ("task=example_tasks:Streamed", "mode=train", "export_at_end=False", "steps_per_loop=2",
           "checkpoint_every=2")
  first = helpers.run_cli(tmp_path, "configs/fashion_mnist.py:smoke", "train_steps=2", *extra)
  assert first.returncode == 0, first.stderr[-2000:]
  second = helpers.run_cli(tmp_path, "configs/fashion_mnist.py:smoke", "train_steps=4",
                           "strategy=mirrored", "cpu_replicas=2", *extra)
  assert second.returncode == 0, second.stderr[-2000:]
  assert "was saved for (workers, replicas, batch) = [1, 1, 32], not [1, 2, 16]" in second.stderr
  assert "skipping the 2 micro-batches" in second.stderr


def test_tf_data_iterator_of_another_update_is_not_restored(tmp_path):
  """data_state/worker_0/ckpt-4 holding the iterator saved at update 2 (a backup mixed by hand)
  was restored silently: the resumed run trained on batches 3-4 again (a probe, 2026-12-07)."""
  extra = ("task=example_tasks:Streamed", "mode=train", "export_at_end=False", "steps_per_loop=2",
           "checkpoint_every=2", "keep_checkpoints=3")
  first = helpers.run_cli(tmp_path, "configs/fashion_mnist.py:smoke", "train_steps=4", *extra)
  assert first.returncode == 0, first.stderr[-2000:]
  state = tmp_path / "data_state" / "worker_0"
  for older in state.glob("ckpt-2.*"):
    shutil.copyfile(older, state / older.name.replace("ckpt-2", "ckpt-4"))
  second = helpers.run_cli(tmp_path, "configs/fashion_mnist.py:smoke", "train_steps=6", *extra)
  assert second.returncode == 0, second.stderr[-2000:]
  assert "was saved at update 2, not 4" in second.stderr, second.stderr[-3000:]
  assert "skipping the 4 micro-batches" in second.stderr


class _TagSums(example_tasks.NoMetrics):
  """Examples with a variable-length field of 1..5 values, which the loss sums per example. Its
  `form`: `sparse` (what `tf.io.VarLenFeature` parses to), `ragged` ([1, None] per example),
  or `dense` (the sums themselves, for comparison)."""

  def __init__(self, config, form):
    super().__init__(config)
    self._form = form

  def _examples(self, num_examples, seed):
    arrays = example_tasks._arrays(num_examples, seed)  # pylint: disable=protected-access

    def example(e):
      tags = e["x"][:tf.cast(tf.abs(e["x"][0]) * 2, tf.int32) % 5 + 1]
      field = {"sparse": lambda: tf.sparse.from_dense(tags), "dense": lambda: tf.reduce_sum(tags),
               "ragged": lambda: tf.RaggedTensor.from_row_lengths(tags, tf.shape(tags))}
      return {"x": e["x"], "y": e["y"], "tags": field[self._form]()}
    return tf.data.Dataset.from_tensor_slices(arrays).map(example)

  def train_data(self):
    return lambda: self._examples(300, 1).shuffle(64, seed=3)

  def eval_data(self):  # 50: the last batch of 32 is padded.
    return lambda: self._examples(50, 2)

  def per_example_loss(self, model, batch, training):
    tags = batch["tags"]
    total = {"sparse": lambda: tf.sparse.reduce_sum(tags, axis=1), "dense": lambda: tags,
             "ragged": lambda: tf.reduce_sum(tags, axis=[1, 2])}[self._form]()
    logits = model(batch["x"] * (1.0 + 0.1 * tf.reshape(total, [-1, 1])), training=training)
    return base_task.LossOutput(
        loss=tf.nn.sparse_softmax_cross_entropy_with_logits(batch["y"], logits))


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_sparse_and_ragged_fields_train_and_evaluate_as_their_dense_twin(tmp_path, strategy):
  """A SparseTensor field failed in the first step ('SparseTensor' object is not subscriptable:
  the input iterator's slice for each replica), and sparse and ragged fields failed in
  evaluation (padding the last batch). Each replica now gets its own rows, and padded rows are
  empty."""
  overrides = {"train_steps": 4, "steps_per_loop": 2, "checkpoint_every": 2, "eval_every": 4,
               "mode": "train_and_eval", "accumulation.steps": 2}
  if strategy == "mirrored":
    overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
  evaluations = {}
  for form in ("dense", "sparse", "ragged"):
    config = helpers.tiny_config(**overrides)
    evaluations[form] = run.run(config, str(tmp_path / form), task=_TagSums(config, form))["eval"]
  _, dense = helpers.checkpoint_weights(tmp_path / "dense")
  for form in ("sparse", "ragged"):
    assert evaluations[form]["examples"] == 50
    assert abs(evaluations[form]["loss"] - evaluations["dense"]["loss"]) <= 1e-6, form
    _, weights = helpers.checkpoint_weights(tmp_path / form)
    for name, value in dense.items():
      np.testing.assert_allclose(weights[name], value, rtol=0, atol=1e-6, err_msg=(form, name))


# ------------------------------------------------------------------------------ export --------
def test_export_round_trips_in_a_fresh_process(tmp_path):
  config = helpers.tiny_config(**{"task": "text_classification", "text.train_examples": 128,
                                  "text.test_examples": 32, "train_steps": 2,
                                  "steps_per_loop": 2, "eval_every": 2, "export_at_end": True})
  result = run.run(config, str(tmp_path))
  path = result["export"]
  assert path == str(tmp_path / "export" / "2") and os.path.isdir(path)
  # The model to compare with: rebuilt and restored from the run's checkpoint.
  strategy, trainer = helpers.build(helpers.tiny_config(**{
      "task": "text_classification", "text.train_examples": 128, "text.test_examples": 32,
      "mode": "eval"}), tmp_path)
  del strategy
  tokens = np.random.RandomState(0).randint(1, 1000, (5, 16)).astype(np.int32)
  np.save(tmp_path / "tokens.npy", tokens)
  expected = trainer.model(tokens, training=False).numpy()
  script = ("import sys, numpy as np, tensorflow as tf\n"
            "m = tf.saved_model.load(sys.argv[1])\n"
            "out = m.serve(np.load(sys.argv[2]))\n"
            "np.save(sys.argv[3], out.numpy())\n")
  done = subprocess.run(["timeout", "-k", "5", "120", sys.executable, "-c", script, path,
                         str(tmp_path / "tokens.npy"), str(tmp_path / "served.npy")],
                        capture_output=True, text=True, timeout=140, check=False,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert done.returncode == 0, done.stderr[-2000:]
  served = np.load(tmp_path / "served.npy")
  assert served.shape == expected.shape == (5, 2)
  assert np.max(np.abs(served - expected)) <= 1e-6


class WordsAndSizes(keras.Model):
  """A subclassed model over a dict with a string field."""

  def __init__(self):
    super().__init__()
    self.lookup = keras.layers.StringLookup(vocabulary=["cat", "dog", "horse"])
    self.embed = keras.layers.Embedding(4, 3)
    self.out = keras.layers.Dense(2)

  def call(self, inputs):
    words = self.embed(self.lookup(inputs["word"]))
    return self.out(tf.concat([words, inputs["size"]], axis=-1))


def _words_and_sizes(n):
  rng = np.random.RandomState(n)
  return {"word": np.array(["cat", "dog", "horse", "eel"])[rng.randint(0, 4, n)],
          "size": rng.normal(size=(n, 1)).astype(np.float32), "y": rng.randint(0, 2, n)}


class WordsAndSizesTask(base_task.Task):
  """Passes the whole batch (labels too) to a subclassed model; no serving_signature()."""

  def build_model(self):
    self.model = WordsAndSizes()
    self.model(_words_and_sizes(2))
    return self.model

  def train_data(self):
    return _words_and_sizes(64)

  def eval_data(self):
    return None

  def per_example_loss(self, model, batch, training):
    logits = model(batch, training=training)
    return base_task.LossOutput(loss=tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=batch["y"], logits=logits))


def test_a_subclassed_model_exports_the_inputs_the_task_gives_it(tmp_path):
  """Keras guessed float32 for every input of a subclassed model: the export of this model took
  a float for the words, lost the field names, and could not serve (exit 0 all the same)."""
  config = helpers.tiny_config(**{"train_steps": 2, "steps_per_loop": 2, "export_at_end": True,
                                  "mode": "train"})
  task = WordsAndSizesTask(config)
  loaded = tf.saved_model.load(run.run(config, str(tmp_path), task=task)["export"])
  serving = loaded.signatures["serving_default"]
  assert {n: s.dtype for n, s in serving.structured_input_signature[1].items()} == {
      "word": tf.string, "size": tf.float32}  # Not `y`: the model never reads it.
  inputs = _words_and_sizes(5)
  del inputs["y"]
  expected = task.model(inputs, training=False).numpy()
  served = next(iter(serving(word=tf.constant(inputs["word"]),
                             size=tf.constant(inputs["size"])).values())).numpy()
  assert np.max(np.abs(served - expected)) <= 1e-6
  assert np.max(np.abs(loaded.serve(inputs).numpy() - expected)) <= 1e-6


class PositionalDense(keras.Model):
  def __init__(self):
    super().__init__()
    self.dense = keras.layers.Dense(2)

  def call(self, x, training=False):
    return self.dense(x)


class _PositionalTask(example_tasks.NoMetrics):
  """Passes one field, as it is, to a subclassed model (as `model(batch["x"])`)."""

  def build_model(self):
    self.model = PositionalDense()
    self.model(np.zeros((1, 12), np.float32))
    return self.model


def test_a_subclassed_models_positional_input_is_named_after_its_field(tmp_path):
  # It was `args_0` (a probe, 2026-12-07): a serving client had to guess.
  config = helpers.tiny_config(**{"train_steps": 2, "steps_per_loop": 2, "export_at_end": True,
                                  "mode": "train"})
  task = _PositionalTask(config)
  loaded = tf.saved_model.load(run.run(config, str(tmp_path), task=task)["export"])
  serving = loaded.signatures["serving_default"]
  assert list(serving.structured_input_signature[1]) == ["x"]
  x = np.random.RandomState(0).normal(size=(3, 12)).astype(np.float32)
  served = next(iter(serving(x=tf.constant(x)).values())).numpy()
  assert np.max(np.abs(served - task.model(x).numpy())) <= 1e-6


def test_mode_export_writes_the_checkpointed_model(tmp_path, monkeypatch):
  config = helpers.tiny_config(**{"train_steps": 2, "steps_per_loop": 2, "eval_every": 2})
  run.run(config, str(tmp_path))
  monkeypatch.chdir(tmp_path.parent)  # A relative workdir: result.json holds the absolute path.
  result = run.run(helpers.tiny_config(mode="export"), tmp_path.name)
  assert result["global_step"] == 2 and result["export"] == str(tmp_path / "export" / "2")
  with open(tmp_path / "result.export.json") as f:
    assert json.load(f)["export"] == str(tmp_path / "export" / "2")


def test_reading_modes_leave_a_tf_data_training_input_alone(tmp_path, caplog):
  # mode=eval restored the training iterator, and warned about skipping micro-batches it would
  # never draw (a probe, 2026-12-07).
  config = lambda **more: helpers.tiny_config(**{"task": "example_tasks:Streamed",
                                                 "train_steps": 2, "steps_per_loop": 2, **more})
  run.run(config(mode="train"), str(tmp_path))
  with caplog.at_level("INFO"):
    result = run.run(config(mode="eval"), str(tmp_path))
  assert result["global_step"] == 2 and result["eval"]["examples"] == 50
  assert "micro-batches" not in caplog.text and "input iterator" not in caplog.text


class _WordsAndSizesStreamed(WordsAndSizesTask):
  """WordsAndSizesTask from tf.data factories, with evaluation data."""

  def train_data(self):
    arrays = _words_and_sizes(64)
    return lambda: tf.data.Dataset.from_tensor_slices(arrays)

  def eval_data(self):
    arrays = _words_and_sizes(20)
    return lambda: tf.data.Dataset.from_tensor_slices(arrays)


class _TrainingFilesAbsent(_WordsAndSizesStreamed):
  """The same task on a machine that holds only the evaluation data."""

  def train_data(self):
    def make():
      return tf.data.Dataset.list_files("/nonexistent/microstep/train-*.tfrecord", shuffle=False)
    return make


def test_reading_modes_never_build_the_training_pipeline(tmp_path):
  # mode=eval and mode=export called the training data function (for the evaluation fields'
  # check and a subclassed model's export specs): an evaluation machine without the training
  # files ended in an InvalidArgumentError traceback ("No files matched pattern").
  config = lambda mode: helpers.tiny_config(**{"train_steps": 2, "steps_per_loop": 2,
                                               "mode": mode, "export_at_end": False})
  run.run(config("train"), str(tmp_path), task=_WordsAndSizesStreamed(config("train")))
  result = run.run(config("eval"), str(tmp_path), task=_TrainingFilesAbsent(config("eval")))
  assert result["global_step"] == 2 and result["eval"]["examples"] == 20
  task = _TrainingFilesAbsent(config("export"))
  loaded = tf.saved_model.load(run.run(config("export"), str(tmp_path), task=task)["export"])
  serving = loaded.signatures["serving_default"]
  assert {n: s.dtype for n, s in serving.structured_input_signature[1].items()} == {
      "word": tf.string, "size": tf.float32}  # From the evaluation data's fields.
  inputs = _words_and_sizes(5)
  del inputs["y"]
  assert np.max(np.abs(loaded.serve(inputs).numpy() -
                       task.model(inputs, training=False).numpy())) <= 1e-6


def test_mode_eval_names_a_field_the_loss_reads_that_evaluation_data_lacks(tmp_path):
  config = helpers.tiny_config(**{"train_steps": 2, "steps_per_loop": 2, "eval_every": 2})
  config.drop_labels = False
  run.run(config, str(tmp_path), task=_EvalWithoutLabels(config))
  config.mode, config.drop_labels = "eval", True
  with pytest.raises(errors.DataError, match=r"^eval_data\(\) has no field 'y', which "
                     r"_EvalWithoutLabels reads in evaluation; its fields: x$"):
    run.run(config, str(tmp_path), task=_EvalWithoutLabels(config))
