"""What a task's `train_data()` / `eval_data()` may return, recognised and checked (eager, host).

`as_source` turns it into one of two kinds (see `trainer.base_task`):
* an `ExampleSource` (random access): a dict of equally long arrays, an `.npz` path, a pandas
  DataFrame (its columns), an object with `__len__` and `__getitem__` returning dicts of arrays,
  or an `ExampleSource` the task made itself;
* a `DatasetFactory`: a function returning a `tf.data.Dataset` of example dicts.

Mistakes (a tuple as for `model.fit`, a Dataset instead of a function, NaN in the arrays, a record
that raises) fail here, at start, with one line naming the field or the record. `trainer.data`
turns either kind into per-replica batches.
"""
import dataclasses
import inspect
import os
import traceback
from typing import Any, Callable, Optional

from absl import logging
import numpy as np
import tensorflow as tf

from trainer import base_task
from trainer import errors

# The field of every batch that marks real examples (1) and padding (0): microstep adds it
# (`trainer.data`), so a task's data may not have a field of this name.
VALID_KEY = "_valid"
_WARNED_RANK = set()  # Data functions whose unknown-rank fields were logged (once each).


@dataclasses.dataclass(frozen=True)
class DatasetFactory:
  """A user's `tf.data` factory: `make()` or `make(input_context)` -> dataset of example dicts."""
  make: Callable[..., tf.data.Dataset]

  @property
  def name(self):
    """The data function's name for messages (the object itself if it has none)."""
    return getattr(self.make, "__name__", self.make)

  @property
  def takes_input_context(self) -> bool:
    try:
      return len(inspect.signature(self.make).parameters) >= 1
    except (TypeError, ValueError):
      return False

  def dataset(self, input_context) -> tf.data.Dataset:
    dataset = self.make(input_context) if self.takes_input_context else self.make()
    if not isinstance(dataset, tf.data.Dataset):
      hint = (": wrap it, e.g. `lambda: tf.data.Dataset.from_generator(gen, output_signature="
              "...)`" if inspect.isgenerator(dataset) else "")
      raise errors.DataError(
          f"the data function {self.name!r} returned a "
          f"{type(dataset).__name__}; it must return a tf.data.Dataset{hint}")
    spec = dataset.element_spec  # Not a dict: refused with the first batch (`_checked`).
    unknown = sorted(name for name, field in (spec.items() if isinstance(spec, dict) else ())
                     if any(isinstance(s, tf.TensorSpec) and s.shape.rank is None
                            for s in tf.nest.flatten(field)))
    if unknown and self.make not in _WARNED_RANK:  # A loss may reshape it; a model cannot.
      _WARNED_RANK.add(self.make)
      logging.warning("the data function %r yields field(s) %s of unknown rank (e.g. from "
                      "tf.numpy_function or tf.io.parse_tensor); a Keras model cannot read "
                      "such a field: give it a shape in your map, e.g. `tf.ensure_shape(value, "
                      "[28, 28])`", self.name, unknown)
    if self.takes_input_context:
      return dataset
    if input_context.num_input_pipelines > 1:
      dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset


# ------------------------------------------------------------------ recognising sources -------
def _check_arrays(arrays: dict, what: str) -> dict:
  if not arrays:
    raise errors.DataError(f"{what} is an empty dict; expected name -> array")
  nested = sorted(str(k) for k, v in arrays.items() if isinstance(v, dict))
  if nested:  # np.asarray made a 0-d object array of it, refused below as "no leading dimension".
    raise errors.DataError(
        f"{what} field {nested[0]!r} is a dict; a dict of arrays is flat, name -> array: "
        f"flatten it (e.g. '{nested[0]}/...'), or return a tf.data function, whose elements "
        "may nest")
  uneven = sorted(str(k) for k, v in arrays.items()
                  if isinstance(v, (tf.RaggedTensor, tf.SparseTensor)))
  if uneven:  # np.asarray made a 0-d object array of it: "no leading dimension" (a probe).
    raise errors.DataError(
        f"{what} field {uneven[0]!r} is a tf.{type(arrays[uneven[0]]).__name__}; a dict of "
        "arrays holds dense arrays: pad it to one length (with a mask or weight 0), or return a "
        "tf.data function, whose elements may be ragged or sparse")
  arrays = {str(k): np.asarray(v) for k, v in arrays.items()}
  if VALID_KEY in arrays:
    raise errors.DataError(f"{what} has a field named {VALID_KEY!r}, which microstep reserves")
  sizes = {k: (v.shape[0] if v.ndim else None) for k, v in arrays.items()}
  if len(set(sizes.values())) != 1 or None in sizes.values():
    raise errors.DataError(f"{what} arrays must share one leading dimension; got {sizes}")
  if next(iter(sizes.values())) == 0:
    raise errors.DataError(f"{what} is empty; expected at least one example")
  for name, array in arrays.items():
    if array.dtype == object:
      arrays[name] = array = _strings_from_objects(array, f"{what} field {name!r}")
    if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
      raise errors.DataError(f"{what} field {name!r} contains NaN or Inf values")
  return arrays


def _strings_from_objects(array: np.ndarray, what: str) -> np.ndarray:
  """An object array of Python str (or of bytes), as pandas gives text columns, becomes a
  string array; one of mixed or other Python objects raises DataError."""
  kinds = {type(value) for value in array.ravel()}
  if len(kinds) == 1 and kinds <= {str, bytes}:
    return array.astype(kinds.pop())
  raise errors.DataError(
      f"{what} has dtype object holding {', '.join(sorted(k.__name__ for k in kinds))}; "
      "allowed: numbers, or text of one kind (all str or all bytes)")


def _load_npz(path: str, what: str) -> dict:
  if not os.path.isfile(path):
    raise errors.DataError(f"{what}: {path!r} is not a file")
  try:
    with np.load(path, allow_pickle=False) as npz:
      return {name: npz[name] for name in npz.files}
  except (OSError, ValueError, EOFError) as e:
    raise errors.DataError(f"{what}: {path!r} is not a readable .npz file "
                           f"({type(e).__name__})") from None


def arrays_source(arrays: dict, what: str = "data") -> base_task.ExampleSource:
  """Random access over a dict of equally long arrays: `tf.gather` from host tensors.

  Call eagerly: the arrays become eager tensors on the host CPU once, which every input pipeline
  captures (by reference, not copied into its graph).
  """
  arrays = _check_arrays(arrays, what)
  with tf.device("/cpu:0"):
    tensors = {k: tf.constant(v) for k, v in arrays.items()}

  def take(ids, positions):
    del positions
    return {k: tf.gather(v, ids) for k, v in tensors.items()}
  return base_task.ExampleSource(num_examples=len(next(iter(arrays.values()))), take=take)


def indexable_source(indexable, what: str = "data") -> base_task.ExampleSource:
  """Random access over any object with `__len__` and `__getitem__(i) -> dict of arrays`.

  Records are read in Python (`tf.numpy_function`) for each batch; their structure and dtypes
  come from record 0. A later record whose field does not cast to record 0's dtype within its
  kind (a float where record 0 holds an int) fails the step with one line naming it; strings
  keep their length.
  """
  size = len(indexable)
  if size == 0:
    raise errors.DataError(f"{what} has no records (len 0)")
  first = _get(indexable, 0, what)
  if not isinstance(first, dict):
    raise errors.DataError(f"{what}[0] is a {type(first).__name__}; records must be dicts of "
                           "arrays, e.g. {'image': ..., 'label': ...}")
  first = _check_arrays({k: np.asarray(v)[None] for k, v in first.items()}, f"{what}[0]")
  names = sorted(first)
  dtypes = [tf.as_dtype(first[n].dtype) for n in names]

  def read(ids):
    records = [_record(indexable, int(i), names, what) for i in ids]
    return [_column(records, ids, n, first[n], what) for n in names]

  def take(ids, positions):
    del positions
    columns = tf.numpy_function(read, [ids], dtypes, stateful=False)
    return {n: tf.ensure_shape(c, [None] + list(first[n].shape[1:]))
            for n, c in zip(names, columns)}
  return base_task.ExampleSource(num_examples=size, take=take)


def _get(indexable, i: int, what):
  """`indexable[i]` (host): whatever the user's `__getitem__` raises (an OSError of its storage,
  an IndexError of a wrong `__len__`, a KeyError of its own code) becomes one line naming the
  record and where it was raised, instead of a Python traceback (record 0, read at start) or a
  TensorFlow error wrapping one (an IndexError would even read as the end of the data)."""
  try:
    return indexable[i]
  except errors.MicrostepError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (the user's code: any error)
    raise errors.DataError(f"{what}[{i}] raised {errors.describe_error(e)}{_raised_at(e)}; "
                           "fix the record or its source and rerun (it resumes from the latest "
                           "checkpoint)") from None


def _record(indexable, i: int, names, what):
  """Record `i` of a user's indexable, with record 0's fields (host, inside tf.numpy_function)."""
  record = _get(indexable, i, what)
  if not isinstance(record, dict):
    raise errors.DataError(f"{what}[{i}] is a {type(record).__name__}; records must be dicts of "
                           "arrays, as record 0 is")
  missing = [n for n in names if n not in record]
  if missing:
    raise errors.DataError(f"{what}[{i}] lacks the field(s) {', '.join(map(repr, missing))} "
                           f"that record 0 has; every record needs {', '.join(map(repr, names))}")
  return record


def _raised_at(error: BaseException) -> str:
  """` (file.py:LINE in function)`: the innermost frame of `error`'s traceback, or ''."""
  frames = traceback.extract_tb(error.__traceback__)
  if not frames:
    return ""
  frame = frames[-1]
  return f" ({os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"


def _column(records, ids, name, first, what):
  """Field `name` of `records` stacked in the dtype of `first` (record 0's values of the field,
  with a leading axis of 1; strings of any length); a record of another shape is one line."""
  values = [np.asarray(r[name]) for r in records]
  dtype, text = first.dtype, first.dtype.kind in "US"
  for i, value in zip(ids, values):
    if value.shape != first.shape[1:]:
      raise errors.DataError(
          f"{what}[{int(i)}] field {name!r} has shape {value.shape} where record 0's has "
          f"{first.shape[1:]}; give the field one shape in every record (pad or crop it)")
    if not text and not np.can_cast(value.dtype, dtype, casting="same_kind"):
      raise errors.DataError(
          f"{what}[{int(i)}] field {name!r} holds {value.dtype} values where record 0 holds "
          f"{dtype}; give the field one dtype in every record (e.g. float for every number)")
  # (Strings keep their length: casting to record 0's '<U3' would cut longer ones.)
  return np.stack(values) if text else np.stack(values).astype(dtype)


_SPLITS = frozenset({"train", "test", "val", "valid", "validation", "eval"})  # x_train, y_test...


def as_source(obj: Any, what: str):
  """A task's data (see `trainer.base_task`) as an `ExampleSource` or a `DatasetFactory`."""
  if isinstance(obj, (base_task.ExampleSource, DatasetFactory)):
    return obj
  if isinstance(obj, dict):
    return arrays_source(obj, what)
  if isinstance(obj, (str, os.PathLike)):
    path = os.fspath(obj)
    if not path.endswith(".npz"):
      raise errors.DataError(f"{what}={path!r}: a path source must be an .npz file")
    arrays = _load_npz(path, what)
    splits = sorted({name.rsplit("_", 1)[-1] for name in arrays} & _SPLITS)
    if len(splits) > 1:
      raise errors.DataError(
          f"{what}={path!r} holds {len(splits)} splits ({', '.join(splits)}); return a dict of "
          "one split's arrays, e.g. {'x': npz['x_train'], 'y': npz['y_train']}, or use "
          "configs/npz_arrays.py")
    return arrays_source(arrays, f"{what} ({path})")
  if isinstance(obj, tuple) and len(obj) in (2, 3) and any(hasattr(p, "shape") for p in obj):
    raise errors.DataError(f"{what} is a tuple of arrays, (x, y) as for model.fit; return ONE "
                           "dict of arrays holding the labels too, e.g. {'x': x, 'label': y}")
  if isinstance(obj, tf.data.Dataset):
    raise errors.DataError(f"{what} is a tf.data.Dataset; return a function that builds it "
                           "(e.g. `return lambda: dataset`) so each input pipeline makes its own")
  if hasattr(obj, "columns") and hasattr(obj, "iloc"):  # A pandas DataFrame: df[0] is a column.
    return arrays_source({str(c): obj[c].to_numpy() for c in obj.columns}, what)
  if hasattr(obj, "__len__") and hasattr(obj, "__getitem__"):
    return indexable_source(obj, what)
  if callable(obj):
    return DatasetFactory(obj)
  raise errors.DataError(
      f"{what} is a {type(obj).__name__}; allowed: dict of arrays, .npz path, an object with "
      "__len__ and __getitem__, an ExampleSource, or a function returning a tf.data.Dataset")


def num_examples(source) -> Optional[int]:
  """N for random-access sources; None for tf.data factories (unknown until read)."""
  return source.num_examples if isinstance(source, base_task.ExampleSource) else None
