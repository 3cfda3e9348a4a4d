"""Model state that replicas write locally (BatchNorm moving statistics), kept identical.

Keras 3 creates non-trainable variables such as BatchNormalization's `moving_mean` and
`moving_variance` as mirrored variables with aggregation NONE; a write in replica context then
changes only the local copy, so after a few updates every replica holds different statistics and
evaluation or checkpoints depend on which replica is asked.

microstep finds these variables by watching which float, non-trainable model variables the
training forward pass writes while it is traced (`WriteRecorder`), sends their local values
through the update's ONE packed all-reduce (no extra collective) and writes the mean back on every
replica (`assign_means`): a local write in replica context. Variables nobody writes are never
touched, so frozen weights cannot drift by rounding. Variables with aggregation MEAN/SUM/...
are left to TensorFlow, which synchronises them itself.

With accumulation (k > 1) these writes happen once per micro-step; `warn_state_writes` names
them once (BatchNorm's statistics too, under `accumulation.batchnorm=per_micro_batch`). Integer
state (a counter) is never averaged: each replica keeps its own, and the same warning names it.

Stateful RNN layers keep per-sequence state that must NOT be averaged; set
`config.replica_state = "local"` for them (the default is "mean").
"""
import contextlib
import threading

from absl import logging
import keras
import tensorflow as tf


_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _writable_state(model) -> list:
  """Non-trainable model variables with aggregation NONE (eager or traced)."""
  out = []
  for var in model.non_trainable_variables:
    backing = getattr(var, "value", var)
    aggregation = getattr(backing, "aggregation", tf.VariableAggregation.NONE)
    if aggregation == tf.VariableAggregation.NONE:
      out.append(var)
  return out


_WATCHERS = []  # (ids, written) of every open `writes_to`, whichever thread opened it.
_WATCHERS_LOCK = threading.Lock()
_OWN_ASSIGN = []  # [keras.Variable's own `assign`, None if inherited] while patched.


@contextlib.contextmanager
def writes_to(ids):
  """Yields a set that collects which of the Keras variables `ids` (their `id()`) are assigned
  while the context is open.

  Patches `keras.Variable.assign` (through which `assign_add`/`assign_sub` and Keras' seed
  generators also go) while any such context is open: it acts while tracing and costs nothing
  at run time. One patch serves every open context, so contexts may close in any order (the
  replicas of a MirroredStrategy trace in threads that interleave at a `merge_call`).
  """
  written = set()
  entry = (ids, written)
  with _WATCHERS_LOCK:
    if not _WATCHERS:
      cls = keras.Variable
      _OWN_ASSIGN.append(cls.__dict__.get("assign"))
      original = cls.assign

      def assign(variable, value):
        for watched, seen in list(_WATCHERS):
          if id(variable) in watched:
            seen.add(id(variable))
        return original(variable, value)
      cls.assign = assign
    _WATCHERS.append(entry)
  try:
    yield written
  finally:
    with _WATCHERS_LOCK:
      _WATCHERS.remove(entry)
      if not _WATCHERS:
        own = _OWN_ASSIGN.pop()
        if own is None:
          del keras.Variable.assign
        else:
          keras.Variable.assign = own


class WriteRecorder:
  """Learns, at trace time, which state variables a forward pass writes.

  `with recorder.watching(): forward...` (trace time, `writes_to`). `variables` lists the float
  ones seen, in `model` order (those are averaged); `integers` the others (counters: never
  averaged).
  """

  def __init__(self, model):
    # Random layers' seed states (Dropout) are left out: a new mask per micro-step and per
    # replica is what they are for, not state that should move once per update.
    seeds = {id(state) for state in seed_states(model)}
    self._candidates = [v for v in _writable_state(model) if id(v) not in seeds]
    self._ids = {id(v) for v in self._candidates}
    self._written = set()

  @contextlib.contextmanager
  def watching(self):
    with writes_to(self._ids) as written:
      try:
        yield
      finally:
        self._written |= written

  @property
  def variables(self) -> list:
    return [v for v in self._candidates if id(v) in self._written and v.dtype in _FLOATS]

  @property
  def integers(self) -> list:
    return [v for v in self._candidates if id(v) in self._written and v.dtype not in _FLOATS]


def warn_state_writes(recorder: WriteRecorder, micro_steps: int, micro_batch: int,
                      replicas: int) -> None:
  """Logs the state the forward pass writes when it runs k > 1 times per update (eager, host,
  after the first trace): a running mean or a counter then moves k times per update where one
  batch of k x b would move it once. BatchNorm's statistics are named too: trainable BatchNorm
  with k > 1 runs only when opted in (docs/accumulation.md). With several replicas, integer
  state is named as well: it is not averaged, so each replica keeps its own count.
  """
  integers = [v.path for v in recorder.integers]
  if replicas > 1 and integers:
    logging.warning(
        "%d replicas: the forward pass writes the integer state %s, which is not averaged "
        "across replicas: each keeps its own value, and checkpoints hold the first replica's "
        "(docs/tasks.md)", replicas, ", ".join(integers))
  written = [v.path for v in recorder.variables + recorder.integers]
  if micro_steps > 1 and written:
    logging.warning(
        "`accumulation.steps`=%d: the forward pass writes %s once per micro-step, %d times per "
        "update, where one batch of %d would write it once (docs/accumulation.md)",
        micro_steps, ", ".join(written), micro_steps, micro_steps * micro_batch)


def local_values(variables) -> list:
  """This replica's values (replica context, traced)."""
  return [tf.identity(tf.cast(tf.convert_to_tensor(v), tf.float32)) for v in variables]


def assign_means(variables, means) -> None:
  """Writes each mean into this replica's copy (replica context, local, no communication)."""
  for var, mean in zip(variables, means):
    var.assign(tf.cast(mean, var.dtype))


def seed_states(model) -> list:
  """The state variables of every Keras SeedGenerator of `model` (Dropout and friends).
  Eager, at build time (the trainer and gradcache keep the list); it only walks the layers.

  Keras leaves them out of `model.weights`; the trainer checkpoints them (a resumed run draws
  the masks the uninterrupted one would have) and gradcache sets them per micro-batch.
  """
  states = []
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    for generator in getattr(layer, "_seed_generators", []):
      states.append(generator.state)
  return states


def task_seed_states(task, model) -> list:
  """The state variables of the Keras SeedGenerators a task keeps itself, outside `model`: in
  an attribute, directly or inside a Keras layer (augmentation: `GaussianNoise`, `RandomFlip`),
  or in a list, tuple or dict there; in attribute-name order. Eager, at build time.

  Until 2026-12-07 the checkpoint left them out: a resumed run drew other noise than an
  uninterrupted one (0.14 in the weights after 8 updates, a probe), without a word.
  """
  known = {id(state) for state in seed_states(model)}
  found = []

  def visit(value, nested):
    generators = []
    if isinstance(value, keras.random.SeedGenerator):
      generators = [value]
    elif isinstance(value, keras.layers.Layer):
      generators = [g for layer in value._flatten_layers()  # pylint: disable=protected-access
                    for g in getattr(layer, "_seed_generators", [])]
    elif not nested and isinstance(value, (list, tuple)):
      for item in value:
        visit(item, True)
    elif not nested and isinstance(value, dict):
      for key in sorted(value, key=str):
        visit(value[key], True)
    for generator in generators:
      if id(generator.state) not in known:
        known.add(id(generator.state))
        found.append(generator.state)

  for name in sorted(vars(task)):
    visit(getattr(task, name), False)
  return found
