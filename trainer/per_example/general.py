"""The general path: per-example gradients of variables that have no direct formula.

`general_path` chooses how (the `per_example.general_path` setting):
* `vectorized_map` (default): `tf.vectorized_map` (pfor) of one example's gradient, i.e. the
  loop of single-example GradientTapes, vectorized. Fast, but pfor has no vectorized form for
  some kernels (it falls back to a while_loop), and TF 2.20 with oneDNN on (TF's x86 default)
  kills the process with a segmentation fault when it vectorizes a forward pass through Keras
  MultiHeadAttention at B >= 2, or any batched `tf.matmul` of an example's [1, T, D] and a
  weight (B >= 4 on an Intel Xeon). Models built from the layers of `layers.py` and `conv.py` never
  get here. Where pfor cannot convert the function at all (it raises while tracing, e.g. an
  LSTM over a masked Embedding: "`dtype` variant is not compatible"), the `loop` below runs
  instead, with a logged warning; an error of the function itself (the user's loss) is raised
  as the loop raises it. `vectorized_map` also runs as `loop` where pfor is known to fail: for
  ragged or sparse batches (some of it only at run time), and, on oneDNN's CPU kernels, for
  models with Keras attention or whose single-example graph has batched matmuls (`tf.matmul` of
  a sequence and a weight, as Dense on sequences and `keras.ops.einsum` run; the segfault above,
  `kernels.PFOR_CRASH_OPS`), and, inside a function XLA compiles (`xla`, TPUs), for models with
  a while loop (RNN layers: pfor's form of it does not compile, and the error comes at run time,
  past any fallback; `kernels.PFOR_XLA_FAILS_OPS`). Logged once per model. `_chosen_path` decides.
* `loop`: a compiled `tf.while_loop` over the examples, each iteration one example's
  GradientTape. Slower (B small forward/backward passes) but nothing is vectorized, so no crash.
  Called eagerly, the loop is wrapped in a `tf.function` (traced on every call).
* `error`: refuse, with a one-line ValueError naming the variables and why their layers have no
  direct formula (raised when the `Recorder` is built).

Each general-path example runs its own forward pass (batch size 1): random layers draw their own
masks there, and the state those passes write (seeds, counters) is restored after them
(`_state_kept`). Runs eagerly or traced, in replica or cross-replica context; no communication.
"""
import contextlib
import logging as pylogging
import weakref

from absl import logging
import keras
import tensorflow as tf

from trainer import replica_state
from trainer.per_example import kernels

PATHS = ("vectorized_map", "loop", "error")
_WARNED = weakref.WeakSet()  # Models whose pfor crash was logged (once per process).
_OP_TYPES = weakref.WeakKeyDictionary()  # Model -> the op types of its single-example gradient.
_VECTORIZE_WARNED = weakref.WeakKeyDictionary()  # Model -> the failed-pfor lines logged for it.
_WRITTEN = weakref.WeakKeyDictionary()  # Model -> ids of the state its forward writes.


class Refused(ValueError):
  """A model the per-example formulas refuse (e.g. BatchNormalization in training mode).

  Raised inside a layer's call, eagerly or while tracing; its message stays one line: Keras
  leaves an error carrying `_keras_call_info_injected` as it is, AutoGraph one carrying
  `ag_pass_through` (both would otherwise wrap it in many lines). The general path does not
  retry it as a vectorization failure.
  """
  _keras_call_info_injected = True
  ag_pass_through = True

  def __init__(self, message, reason=None):
    super().__init__(message)
    self.reason = reason or message  # Without the advice meant for the library's callers.


def check_path(general_path: str) -> None:
  if general_path not in PATHS:
    raise ValueError(f"`general_path` must be one of {', '.join(PATHS)}; got {general_path!r}.")


def refusal(descriptions) -> Refused:
  """The one-line error for `general_path='error'`; `descriptions`: 'variable (reason)'. Its
  `reason` leaves out the advice that only the API's callers can take (`variables`)."""
  reason = (f"per_example: general_path='error' and {len(descriptions)} variable(s) have no "
            f"direct formula: {'; '.join(descriptions)}")
  return Refused(f"{reason}. Use general_path='loop' or 'vectorized_map', or pass `variables` "
                 "without them.", reason=reason)


def demotion_refusal(layer, problem) -> str:
  """The one-line error for a layer sent to the general path while general_path='error'."""
  return (f"per_example: general_path='error' and {type(layer).__name__} '{layer.name}' cannot "
          f"use its direct formula: {problem}")


def flat_layers(model) -> list:
  """The model and all its nested Keras layers; [] for non-Keras models (general path only)."""
  if not isinstance(model, keras.layers.Layer):
    return []
  return model._flatten_layers(include_self=True, recursive=True)  # pylint: disable=protected-access


def _chosen_path(model, batch, general_path, one_example=None) -> str:
  """'loop' where `vectorized_map` is known to fail or crash (module docstring), else
  `general_path`. `one_example`: the single-example gradient function, traced once per model
  (on a batch of one, in a graph of its own that never runs) to look for the ops that fail."""
  if general_path != "vectorized_map":
    return general_path
  if any(isinstance(t, (tf.RaggedTensor, tf.SparseTensor)) for t in tf.nest.flatten(batch)):
    return "loop"
  crash = "on oneDNN's CPU kernels can crash TF 2.20 (a segmentation fault)"
  op_types = lambda: (frozenset() if one_example is None  # Traced only when asked (cached).
                      else _op_types(model, batch, one_example))
  if kernels.in_xla_context() and op_types() & kernels.PFOR_XLA_FAILS_OPS:
    reason = "pfor's form of a while loop (an RNN layer's) does not compile with XLA"
  elif kernels.pfor_crashes_on(flat_layers(model)):
    reason = f"pfor through Keras attention {crash}"
  elif kernels.pfor_crash_possible() and (found := sorted(op_types() & kernels.PFOR_CRASH_OPS)):
    reason = f"pfor through batched matmuls ({', '.join(found)}) in the model {crash}"
  else:
    return general_path
  if model not in _WARNED:
    _WARNED.add(model)
    logging.warning("per_example: general_path=vectorized_map runs as 'loop' for %s: %s",
                    getattr(model, "name", type(model).__name__), reason)
  return "loop"


def _op_types(model, batch, one_example) -> frozenset:
  """`kernels.op_types_in` the graph of `one_example` on one example; cached per model."""
  if model in _OP_TYPES:
    return _OP_TYPES[model]
  spec = tf.nest.map_structure(
      lambda t: tf.TensorSpec([1] + list(t.shape[1:]), t.dtype), batch)
  try:
    graph = tf.function(one_example, autograph=False).get_concrete_function(spec).graph
    found = kernels.op_types_in(graph)
  except Exception:  # pylint: disable=broad-except
    found = frozenset()  # It fails to trace on one example: the path itself raises, as it would.
  _OP_TYPES[model] = found
  return found


def _example_at(i):
  """Slices example `i` of a batch tensor as a batch of one: dense tensors with a static first
  dimension of 1 (as `tf.vectorized_map` gives them), ragged ones as ragged, sparse as sparse."""
  def example(t):
    if isinstance(t, tf.SparseTensor):
      rest = t.dense_shape[1:]
      return tf.sparse.slice(t, tf.concat([[tf.cast(i, tf.int64)], tf.zeros_like(rest)], 0),
                             tf.concat([[1], rest], 0))
    return t[i:i + 1] if isinstance(t, tf.RaggedTensor) else tf.expand_dims(t[i], 0)
  return example


def check_losses(losses, batch=None):
  """The [B] per-example losses of a loss_fn, or `Refused` (one line) naming what is wrong:
  the rank, an integer dtype (no gradient: every result would be zero), or a length other than
  the `batch`'s leading size (checked while tracing when both are static, else when it runs)."""
  losses = tf.convert_to_tensor(losses)
  if losses.shape.rank != 1:
    raise Refused(
        f"loss_fn must return per-example losses of shape [B]; got shape {losses.shape}.")
  if not (losses.dtype.is_floating or losses.dtype.is_complex):
    raise Refused(f"loss_fn must return floating-point per-example losses; got "
                  f"{losses.dtype.name}, which has no gradient.")
  rows = next((t for t in tf.nest.flatten(batch) if isinstance(t, tf.Tensor) and t.shape.rank),
              None)
  if rows is None:
    return losses
  count, size = losses.shape[0], rows.shape[0]
  if count is not None and size is not None:
    if count != size:
      raise Refused(f"loss_fn must return one loss per example: got {count} losses for a "
                    f"batch of {size}.")
    return losses
  check = tf.debugging.assert_equal(
      tf.shape(losses)[0], tf.shape(rows)[0],
      message="loss_fn must return one loss per example (losses != batch size)")
  with tf.control_dependencies([check]):
    return tf.identity(losses)


def unwrap(v):
  """The tf.Variable (or DistributedVariable) behind a Keras variable; others unchanged.

  Read without autocasting: inside a layer's call under a mixed-precision policy a Keras
  variable's `.value` is a new float16 cast of it, which would identify no variable. A variable
  not yet created is returned as it is.
  """
  if isinstance(v, keras.Variable):
    backend = getattr(v, "_value", None)  # pylint: disable=protected-access
    return v if backend is None else backend
  return v


def gradients(model, loss_fn, batch, variables, general_path, guard):
  """One [B, *var.shape] tensor per variable of `variables`, by the chosen general path.

  `guard()` is a context manager active around each single-example forward pass (the
  recorder's BatchNormalization refusal). The model's state is left as the caller's own
  forward pass left it (`_state_kept`).
  """
  check_path(general_path)
  if general_path == "error" or not variables:
    return _gradients(model, loss_fn, batch, variables, general_path, guard)
  with _state_kept(model, loss_fn, batch, guard):
    return _gradients(model, loss_fn, batch, variables, general_path, guard)


def _state_variables(model) -> list:
  """A Keras model's non-trainable variables and its random layers' seed states (a `tf.Module`
  as the model: none, its variables' writes are not watched)."""
  if not isinstance(model, keras.layers.Layer):
    return []
  found = {id(v): v for v in list(model.non_trainable_variables)
           + replica_state.seed_states(model)}
  return list(found.values())


@contextlib.contextmanager
def _state_kept(model, loss_fn, batch, guard):
  """Undoes what the single-example forward passes write to the model's state.

  They run the loss again, B times or vectorized: a random layer's seed (Dropout) moved on, so
  turning the statistics on changed every later mask and the training (0.03 in the weights
  after 10 updates, found by a probe), and state a layer writes in training (a counter, a
  running mean) was written again. The written variables are found by tracing one example's
  forward pass once (in a graph that never runs, `replica_state.writes_to`); their values are
  read before the general path and assigned back after it, in program order (traced: the
  automatic control dependencies order them; eager: as they come). Nothing is read or
  written for a model whose forward writes no state.
  """
  state = _state_variables(model)
  written = _written_by_forward(model, loss_fn, batch, guard, state) if state else set()
  kept = [(v, tf.identity(unwrap(v))) for v in state if id(v) in written]
  yield
  for variable, value in kept:
    variable.assign(value)


def _written_by_forward(model, loss_fn, batch, guard, state) -> set:
  """Ids of the `state` variables that one example's forward pass writes (trace time); found
  once per model (an eager caller's every call would trace it again)."""
  if model not in _WRITTEN:
    _WRITTEN[model] = _trace_writes(model, loss_fn, batch, guard, state)
  return _WRITTEN[model]


def _one_example_spec(t):
  """The type spec of one example of batch tensor `t` (dense, ragged or sparse)."""
  shape = [1] + list(t.shape[1:])
  if isinstance(t, tf.RaggedTensor):
    return tf.RaggedTensorSpec(shape, t.dtype, t.ragged_rank, t.row_splits.dtype)
  if isinstance(t, tf.SparseTensor):
    return tf.SparseTensorSpec(shape, t.dtype)
  return tf.TensorSpec(shape, t.dtype)


def _trace_writes(model, loss_fn, batch, guard, state) -> set:
  def forward(example):
    with guard():
      return loss_fn(model, example)
  with replica_state.writes_to({id(v) for v in state}) as written:
    try:
      tf.function(forward, autograph=False).get_concrete_function(
          tf.nest.map_structure(_one_example_spec, batch))
    except Exception as e:  # pylint: disable=broad-except  (The general path raises it itself.)
      if not isinstance(e, Refused):  # A refusal: the general path raises it in one line.
        logging.warning("per_example: one example's forward pass did not trace (%s); the "
                        "general path keeps all %d state variables of the model",
                        type(e).__name__, len(state))
      return {id(v) for v in state}  # Keep everything: nothing is known.
  return written


def _gradients(model, loss_fn, batch, variables, general_path, guard):
  if not variables:
    return []
  if general_path == "error":
    raise refusal([getattr(v, "path", getattr(v, "name", "?")) for v in variables])

  def one_example(example):
    with tf.GradientTape() as tape:
      tape.watch([unwrap(v) for v in variables])
      with guard():
        loss = tf.reduce_sum(check_losses(loss_fn(model, example), example))
    # The backend variables: filling an unconnected gradient with zeros fails on a Keras one.
    grads = tape.gradient(loss, [unwrap(v) for v in variables],
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [tf.convert_to_tensor(g) for g in grads]

  def vectorized(batch):
    stacked = lambda b: tf.vectorized_map(
        lambda e: one_example(tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), e)), b)
    if tf.nest.flatten(batch)[0].shape[0] is not None:
      return stacked(batch)
    # With a batch size known only at run time, pfor's conversion of a while_loop (an LSTM's)
    # fails AT RUN TIME for a batch of one (TF 2.20: "Tried to append a tensor with incompatible
    # shape to a list"), where no fallback can catch it: one example takes the loop.
    size = tf.shape(tf.nest.flatten(batch)[0])[0]
    return tf.cond(size > 1, lambda: stacked(batch), lambda: loop(batch))

  def loop(batch):
    size = tf.shape(tf.nest.flatten(batch)[0])[0]
    arrays = [tf.TensorArray(v.dtype, size=size, element_shape=v.shape) for v in variables]

    def body(i, arrays):
      example = tf.nest.map_structure(_example_at(i), batch)
      return i + 1, [a.write(i, g) for a, g in zip(arrays, one_example(example))]

    _, arrays = tf.while_loop(lambda i, _: i < size, body, (tf.constant(0), arrays))
    return [a.stack() for a in arrays]

  if _chosen_path(model, batch, general_path, one_example) == "loop":
    return tf.function(loop)(batch) if tf.executing_eagerly() else loop(batch)
  tf_logger = tf.get_logger()
  level = tf_logger.level
  # pfor logs ~130 lines at ERROR for an op it cannot convert, before raising; the warning below
  # says it in one line, and the loop then gives the answer.
  tf_logger.setLevel(pylogging.CRITICAL)
  try:  # In a function of its own: a conversion that fails while tracing leaves no ops in the
    # caller's graph (a failed pfor's stateful leftovers would still run there).
    return tf.function(vectorized, autograph=False)(batch)
  except (TypeError, ValueError, NotImplementedError) as e:
    if getattr(e, "ag_pass_through", False):  # A refusal: the loop would repeat it.
      raise
    vectorize_error = e
  finally:
    tf_logger.setLevel(level)
  # pfor could not convert the function, or the function itself failed (the user's loss, say):
  # TF's traceback filtering hides which. The loop traces the function without pfor: if that
  # fails too, its error is the function's own and is raised as it is.
  stacked = tf.function(loop)(batch)
  last = (str(vectorize_error).strip().splitlines() or [""])[-1][:300]
  said = f"{type(vectorize_error).__name__}: {last}"
  logged = _VECTORIZE_WARNED.setdefault(model, set())
  if said not in logged:  # Once per model and cause, however often it is traced (per replica).
    logged.add(said)
    logging.warning("per_example: tf.vectorized_map could not vectorize the general path (%s); "
                    "ran general_path='loop' instead", said)
  return stacked
