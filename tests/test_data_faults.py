"""A data source that fails in the middle of a run stops it with one line, and any tf.data
pipeline can be checkpointed.

Found by a probe of faults in users' data (2026-12-05). Before:
* an OSError (or any error) raised by an indexable source's `__getitem__`, a record lacking a
  field, and a damaged or vanished TFRecord file ended in a traceback of TensorFlow's op error
  around the Python one (exit 1); an IndexError of a `__len__` larger than the data read as "the
  training data yields no batch"; a record of another shape said "all input arrays must have the
  same shape" without naming the record or the field;
* a tf.data source with Python or random state (`tf.py_function`, `tf.numpy_function`,
  `Dataset.from_generator`, an unseeded random augmentation) crashed at its first checkpoint
  (FailedPreconditionError: "EagerPyFunc is stateful", from saving the iterator).
In-process through `run.run`; the command line turns `DataError` and `ConfigError` into their
line and exit code 2 (tests/test_robustness.py).
"""
import numpy as np
import pytest
import tensorflow as tf

import example_tasks
import helpers
from trainer import base_task
from trainer import errors
from trainer import run
from trainer import sources

FAULT_AT = 40  # With data.shuffle=False and batch 16: in update 3, after the checkpoint of 2.


def _config(**overrides):
  return helpers.tiny_config(**dict({"train_steps": 4, "steps_per_loop": 2, "mode": "train",
                                     "checkpoint_every": 2, "data.shuffle": False}, **overrides))


def _train(task, tmp_path, **overrides):
  config = _config(**overrides)
  task.config = config
  return run.run(config, str(tmp_path), task=task)


class _Indexable:
  """A user's random-access source whose record FAULT_AT goes wrong as `fault` says."""

  def __init__(self, fault):
    self._arrays, self._fault = example_tasks._arrays(200, 1), fault  # pylint: disable=protected-access

  def __len__(self):
    return 200

  def __getitem__(self, i):
    record = {"x": self._arrays["x"][i], "y": self._arrays["y"][i]}
    if i != FAULT_AT:
      return record
    if self._fault == "oserror":
      raise OSError(5, "Input/output error", "/data/shard-3.rec")
    if self._fault == "index_error":  # A __len__ larger than the data.
      return [][i]
    if self._fault == "missing_field":
      return {"x": record["x"]}
    if self._fault == "other_shape":
      return dict(record, x=np.zeros(13, np.float32))
    return (record["x"], record["y"])


class FromSource(example_tasks.NoMetrics):
  def __init__(self, source):
    super().__init__(None)
    self._source = source

  def train_data(self):
    return self._source

  def eval_data(self):
    return None


@pytest.mark.parametrize("fault,message", [
    ("oserror", r"^train_data\(\)\[40\] raised OSError: \[Errno 5\] Input/output error: "
     r"'/data/shard-3\.rec' \(test_data_faults\.py:\d+ in __getitem__\); fix the record"),
    ("index_error", r"^train_data\(\)\[40\] raised IndexError: list index out of range "
     r"\(test_data_faults\.py:\d+ in __getitem__\)"),
    ("missing_field", r"^train_data\(\)\[40\] lacks the field\(s\) 'y' that record 0 has; "
     r"every record needs 'x', 'y'$"),
    ("other_shape", r"^train_data\(\)\[40\] field 'x' has shape \(13,\) where record 0's has "
     r"\(12,\); give the field one shape in every record"),
    ("not_a_dict", r"^train_data\(\)\[40\] is a tuple; records must be dicts of arrays"),
])
def test_a_failing_record_of_a_random_access_source_is_one_line_naming_it(tmp_path, fault,
                                                                          message):
  with pytest.raises(errors.DataError, match=message) as info:
    _train(FromSource(_Indexable(fault)), tmp_path)
  assert "\n" not in str(info.value)
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-2")


class _FirstRecordMissing(_Indexable):
  def __getitem__(self, i):
    with open(f"/nonexistent-microstep-test/rec{i}.npy", "rb") as f:
      return {"x": np.load(f)}


def test_a_random_access_source_whose_record_0_fails_is_one_line_at_start(tmp_path):
  """Record 0 is read at start for the fields' structure: its error was a Python traceback."""
  with pytest.raises(errors.DataError, match=r"^train_data\(\)\[0\] raised FileNotFoundError: "
                     r"\[Errno 2\] No such file or directory: '/nonexistent-microstep-test/rec0"
                     r"\.npy' \(test_data_faults\.py:\d+ in __getitem__\); fix the record") as info:
    _train(FromSource(_FirstRecordMissing("none")), tmp_path)
  assert "\n" not in str(info.value)


def _write_records(path, num_examples=200):
  arrays = example_tasks._arrays(num_examples, 1)  # pylint: disable=protected-access
  with tf.io.TFRecordWriter(str(path)) as writer:
    for x, y in zip(arrays["x"], arrays["y"]):
      writer.write(tf.train.Example(features=tf.train.Features(feature={
          "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
          "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y]))})).SerializeToString())


def _records_factory(path):
  spec = {"x": tf.io.FixedLenFeature([12], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}
  return lambda: tf.data.TFRecordDataset(str(path)).map(
      lambda s: tf.io.parse_single_example(s, spec))


def test_a_damaged_record_file_is_one_line_with_the_checkpoint_to_resume_from(tmp_path):
  path = tmp_path / "train.tfrecord"
  _write_records(path)
  damaged = bytearray(path.read_bytes())
  middle = len(damaged) // 2
  damaged[middle:middle + 40] = b"\xff" * 40
  path.write_bytes(bytes(damaged))
  with pytest.raises(errors.DataError, match=(
      r"^reading the input data failed \(DataLossError: corrupted record at \d+\); a damaged "
      r"file\? The latest checkpoint is \S+ckpt-6: fix the data and rerun to resume$")):
    _train(FromSource(_records_factory(path)), tmp_path / "run", train_steps=10)


def test_a_missing_record_file_is_one_line(tmp_path):
  with pytest.raises(errors.DataError, match=(
      r"^reading the input data failed \(NotFoundError: \S+gone\.tfrecord; No such file or "
      r"directory\); a missing file\? The latest checkpoint is none: fix the data")):
    _train(FromSource(_records_factory(tmp_path / "gone.tfrecord")), tmp_path / "run")


def _python_loader(fail_at=None):
  """A tf.data factory loading each example in Python (as users read images with PIL)."""
  arrays = example_tasks._arrays(200, 1)  # pylint: disable=protected-access

  def load(i):
    i = int(i)
    if i == fail_at:
      raise OSError(5, "Input/output error", f"/bucket/img-{i}.jpg")
    return arrays["x"][i] * 2.0

  def example(i):
    x = tf.py_function(load, [i], tf.float32)
    return {"x": tf.ensure_shape(x, [12]), "y": tf.gather(arrays["y"], i)}
  return lambda: tf.data.Dataset.range(200).shuffle(64, seed=3).map(example)


def test_a_python_error_in_a_tf_data_pipeline_is_its_own_line(tmp_path):
  with pytest.raises(errors.DataError, match=(
      r"^reading the input data failed \(OSError: \[Errno 5\] Input/output error: "
      r"'/bucket/img-7\.jpg'\)\. The latest checkpoint is \S+: fix the data and rerun to resume$")):
    _train(FromSource(_python_loader(fail_at=7)), tmp_path)


def test_a_python_error_in_a_generator_source_is_an_input_error(tmp_path):
  """`Dataset.from_generator` names its PyFunc node and the iterator only as `[[...]]`: the line
  blamed the model or the loss and named no checkpoint (a probe, 2026-12-07)."""
  arrays = example_tasks._arrays(200, 1)  # pylint: disable=protected-access

  def examples():
    for i in range(200):
      if i == FAULT_AT:
        raise ValueError(f"corrupt record {i}")
      yield {"x": arrays["x"][i], "y": arrays["y"][i]}
  signature = {"x": tf.TensorSpec([12], tf.float32), "y": tf.TensorSpec([], tf.int64)}
  source = lambda: tf.data.Dataset.from_generator(examples, output_signature=signature)
  with pytest.raises(errors.DataError, match=(
      r"^reading the input data failed \(ValueError: corrupt record 40\)\. The latest checkpoint "
      r"is \S+ckpt-2: fix the data and rerun to resume$")):
    _train(FromSource(source), tmp_path)


def _augmented():
  """A seeded shuffle and an unseeded random augmentation (a stateful op)."""
  arrays = example_tasks._arrays(200, 1)  # pylint: disable=protected-access
  return lambda: tf.data.Dataset.from_tensor_slices(arrays).shuffle(64, seed=3).map(
      lambda e: dict(e, x=e["x"] + tf.random.uniform([12], maxval=1e-3)))


@pytest.mark.parametrize("source", [_python_loader, _augmented])
def test_a_pipeline_tensorflow_cannot_save_trains_and_resumes_by_skipping(tmp_path, source):
  """It crashed at the first checkpoint. Now its iterator is not saved, and a restart skips
  the consumed micro-batches: with a deterministic pipeline (the Python loader, seeded shuffle)
  the resumed run equals the uninterrupted one bitwise."""
  _train(FromSource(source()), tmp_path / "resumed", train_steps=2)
  assert not (tmp_path / "resumed" / "data_state").exists() or not any(
      (tmp_path / "resumed" / "data_state").rglob("*.index"))
  assert _train(FromSource(source()), tmp_path / "resumed")["global_step"] == 4
  if source is _python_loader:
    _train(FromSource(source()), tmp_path / "straight")
    helpers.assert_same_weights(tmp_path / "resumed", tmp_path / "straight")


def test_resuming_by_iterator_refuses_a_pipeline_tensorflow_cannot_save(tmp_path):
  with pytest.raises(errors.ConfigError, match=(
      r"^`data\.resume`=iterator but TensorFlow cannot save the tf\.data source's iterator "
      r"\(RandomUniform is stateful: Python or random state, e\.g\. .*\); allowed: auto or skip$")):
    _train(FromSource(_augmented()), tmp_path, **{"data.resume": "iterator"})


class NestedFields(example_tasks.NoMetrics):
  """Elements {"feat": {"a": [6], "b": [6]}, "y"}, the layout of many tfds datasets, or the same
  fields flat ({"a", "b", "y"})."""

  def __init__(self, config, nested=True, tf_data=True):
    super().__init__(config)
    self.nested, self.tf_data = nested, tf_data

  def build_model(self):
    import keras  # pylint: disable=g-import-not-at-top
    a, b = keras.Input((6,), name="a"), keras.Input((6,), name="b")
    joined = keras.layers.Concatenate()([a, b])
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(2)(joined))

  def _data(self, n, seed):
    arrays = example_tasks._arrays(n, seed)  # pylint: disable=protected-access
    fields = {"a": arrays["x"][:, :6], "b": arrays["x"][:, 6:]}
    data = {"feat": fields, "y": arrays["y"]} if self.nested else dict(fields, y=arrays["y"])
    return (lambda: tf.data.Dataset.from_tensor_slices(data)) if self.tf_data else data

  def train_data(self):
    return self._data(200, 1)

  def eval_data(self):
    return self._data(41, 2)

  def per_example_loss(self, model, batch, training):
    inputs = batch["feat"] if self.nested else {"a": batch["a"], "b": batch["b"]}
    logits = model(inputs, training=training)
    return base_task.LossOutput(
        loss=tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["y"], logits=logits))


def test_a_tf_data_source_of_nested_dicts_trains_and_evaluates_as_the_flat_one(tmp_path):
  # As evaluation data it failed at start with a TypeError traceback (padding the last batch
  # took the inner dict for a tensor; a probe, 2026-12-07).
  results = [_train(NestedFields(None, nested=nested), tmp_path / str(nested),
                    mode="train_and_eval", eval_every=4, strategy="mirrored", cpu_replicas=2)["eval"]
             for nested in (True, False)]
  assert results[0]["examples"] == 41
  assert results[0] == results[1]


def test_nested_dicts_of_arrays_are_one_line_naming_the_field(tmp_path):
  with pytest.raises(errors.DataError, match=r"^train_data\(\) field 'feat' is a dict; a dict "
                                             r"of arrays is flat"):
    _train(NestedFields(None, tf_data=False), tmp_path)


@pytest.mark.parametrize("kind", ["RaggedTensor", "SparseTensor"])
def test_a_ragged_or_sparse_field_in_a_dict_of_arrays_is_one_line_saying_so(kind):
  # It said the arrays must share one leading dimension, {'tok': None, 'y': 100}: a length
  # mismatch that was not there (a probe, 2026-12-08).
  tokens = tf.ragged.constant([[1, 2, 3], [4]] * 50)
  field = tokens if kind == "RaggedTensor" else tokens.to_sparse()
  with pytest.raises(errors.DataError, match=rf"^train_data\(\) field 'tok' is a tf\.{kind}; a "
                     r"dict of arrays holds dense arrays: pad it"):
    sources.as_source({"tok": field, "y": np.zeros(100, np.int64)}, "train_data()")


class StringLabels(example_tasks.NoMetrics):
  """Labels "0"/"1" as strings, into Keras' loss, which casts them inside the step."""

  def train_data(self):
    arrays = example_tasks._arrays(200, 1)  # pylint: disable=protected-access
    return dict(arrays, y=arrays["y"].astype(str))

  def per_example_loss(self, model, batch, training):
    import keras  # pylint: disable=g-import-not-at-top
    logits = model(batch["x"], training=training)
    return base_task.LossOutput(loss=keras.losses.sparse_categorical_crossentropy(
        batch["y"], logits, from_logits=True))


def test_string_labels_are_one_line_naming_the_kernel(tmp_path):
  # An UnimplementedError ("Cast string to int64 is not supported") was a 100-line traceback,
  # exit 1 (a probe, 2026-12-07).
  with pytest.raises(errors.DataError, match=r"^TensorFlow rejected a batch at \S+: Cast string "
                                             r"to int64 is not supported .*strings where numbers"):
    _train(StringLabels(None), tmp_path)


def test_another_unimplemented_kernel_keeps_tensorflow_s_error(tmp_path):
  # Not the data's doing (a review, 2026-12-07): it must not read as a rejected batch, exit 2.
  from trainer import step_errors  # pylint: disable=g-import-not-at-top
  with pytest.raises(tf.errors.UnimplementedError, match="deterministic GPU implementation"):
    with step_errors.explained(str(tmp_path), training=True):
      raise tf.errors.UnimplementedError(
          None, None, "A deterministic GPU implementation of SparseSegmentSum is not available")
