"""Recording a forward pass: the direct layers' calls keep what the per-example formulas need.

    recorder = Recorder(model)                  # Python only: which variables are direct
    with tf.GradientTape() as tape:             # the CALLER's tape and forward pass
      with recorder.record(tape) as rec:        # patches the direct layers' `call`
        losses = loss_fn(model, batch)          # [B]
      loss = tf.reduce_sum(losses * c)          # any per-example weights c_i
    grads, dzs = tape.gradient(loss, (variables, rec.outputs))   # ONE backward pass
    per_example = rec.gradients(dzs)            # {index: [B, *shape]} (rows c_i g_i), or ghost.py

While `record` is active, every covered layer (see `layers.py`) runs an equivalent `call` that
watches the output z of its linear part (before bias and activation; plus any intermediate its
formulas need), appends it to `rec.outputs`, and registers one `terms.Term` per covered variable
(and a `terms.Joint` for kernel and bias together). Because row i of z reaches only loss_i, row
i of dz = dloss/dz is c_i times example i's own gradient there, and the terms turn it into
per-example gradients, Gram norms or dots. The recorded forward computes what Keras' `call`
does, up to float rounding where it is recomposed (normalisation as x_hat * gamma + beta,
SeparableConv as depthwise then pointwise). BatchNormalization layers called with training=True
are refused (batch statistics mix the examples).

Context: Python-level patching, active while the `with` block runs: eagerly, or while tracing
inside `tf.function`, in replica or cross-replica context; it never communicates. Under
MirroredStrategy replica functions take turns between sync points, and a forward pass has none,
so replicas never see each other's patches; keep collectives out of the `with` block. The
recorded tensors belong to the current trace: use `rec` in the same function (or replica
function) that recorded it.
"""
import contextlib
import re

import keras
import tensorflow as tf

from trainer.per_example import general
from trainer.per_example import layers

_BN_TYPES = (keras.layers.BatchNormalization,)
_PFOR_BODY = re.compile(r"loop_body(_\d+)?")  # The name scope of a traced vectorized_map's body.


def _loops_over_its_layers(layer) -> bool:
  """Whether `layer` calls its inner layers inside a loop of the graph: a recurrent layer does
  (a tf.while_loop over the time steps) unless unrolled. The tensors recorded there belong to
  the loop's body, which the caller's backward pass cannot reach, so those layers go to the
  general path. (`TimeDistributed` calls its layer in a Python loop when the number of steps is
  static, which records fine; with an unknown number it maps over them, and the recording
  refuses it, see `Recording.watch`.)"""
  return isinstance(layer, keras.layers.RNN) and not layer.unroll


_MISSING = object()
LAYER_METHODS = ("auto", "materialize", "ghost")


def keys(v) -> tuple:
  """The identities a variable is known by: the object the caller holds and the backend
  variable behind a Keras variable (callers and layers may hold either)."""
  return tuple(dict.fromkeys((id(v), id(general.unwrap(v)))))


def _find(mapping, v, default=None):
  return next((mapping[k] for k in keys(v) if k in mapping), default)


def flat_layers(model) -> list:
  """The model and all its nested Keras layers; [] for non-Keras models (general path only)."""
  if not isinstance(model, keras.layers.Layer):
    return []
  return model._flatten_layers(include_self=True, recursive=True)  # pylint: disable=protected-access


def variable_name(v) -> str:
  return getattr(v, "path", None) or getattr(v, "name", "?")


class Recorder:
  """Splits `variables` into direct (recorded) and general-path ones; records forward passes.

  Built eagerly or while tracing (Python only, creates no ops); reusable across steps.

  Args:
    model: a Keras 3 model/layer, or any object with `trainable_variables` (general path only).
    variables: defaults to `model.trainable_variables`.
    general_path: `vectorized_map` | `loop` | `error` for variables without a direct formula
      (see `general.py`); `error` raises here when there are any.
    layer_method: how ghost statistics treat a layer that supports both: `auto` (cheaper by
      the per-layer cost estimate), `materialize` (per-example gradients of that layer, kept),
      `ghost` (Gram norms and forward dots whenever the layer supports them).

  Attributes:
    variables: the variables, in order (indices below refer to it).
    direct_indices / general_indices: sorted indices of recorded / general-path variables.
    general_variables: `variables` at `general_indices`.
  """

  def __init__(self, model, variables=None, *, general_path: str = "vectorized_map",
               layer_method: str = "auto"):
    general.check_path(general_path)
    if layer_method not in LAYER_METHODS:
      raise ValueError(f"`layer_method` must be one of {', '.join(LAYER_METHODS)}; got "
                       f"{layer_method!r}.")
    self.model = model
    self.general_path = general_path
    self.layer_method = layer_method
    self.variables = list(model.trainable_variables if variables is None else variables)
    if not self.variables:
      raise ValueError(
          "per_example: `variables` is empty; pass the variables to differentiate" if variables
          is not None else "per_example: the model has no trainable variables; build it first "
          "(call it once, or start it with keras.Input), unfreeze it, or pass `variables`")
    self._index = {}
    for i, v in enumerate(self.variables):
      for k in keys(v):
        self._index.setdefault(k, i)
    self.layers, covered, reasons = [], set(), {}
    all_layers = flat_layers(model)
    looped = {}
    for wrapper in all_layers:
      if _loops_over_its_layers(wrapper):
        for inner in flat_layers(wrapper)[1:]:
          looped.setdefault(id(inner), wrapper)
    for layer in all_layers:
      rule, reason = layers.rule_for(layer)
      if rule is not None and id(layer) in looped:
        wrapper = looped[id(layer)]
        rule, reason = None, (f"called in a loop by {type(wrapper).__name__} "
                              f"'{wrapper.name}'")
      if rule is None:
        for v in getattr(layer, "_trainable_variables", []):
          for k in keys(v):
            reasons.setdefault(k, f"{type(layer).__name__} '{layer.name}': {reason}")
        continue
      mine = [i for i in map(self.index_of, layers.layer_variables(layer, rule))
              if i is not None]
      if mine:
        self.layers.append((layer, rule))
        covered.update(mine)
    self.direct_indices = sorted(covered)
    self.general_indices = [i for i in range(len(self.variables)) if i not in covered]
    self.general_variables = [self.variables[i] for i in self.general_indices]
    self._bn_layers = [l for l in all_layers if isinstance(l, _BN_TYPES)]
    if general_path == "error" and self.general_indices:
      raise ValueError(general.refusal([
          f"{variable_name(v)} ({_find(reasons, v, 'not reached through a Keras layer')})"
          for v in self.general_variables]))

  def index_of(self, variable):
    """The index of `variable` in `variables` (held as a Keras or a backend variable), or None."""
    return _find(self._index, variable)

  @contextlib.contextmanager
  def record(self, tape):
    """Records the forward pass run inside the block; yields the `Recording`.

    `tape`: the GradientTape that will differentiate the loss (each output is watched on it).
    Raises `general.Refused` at the end of the block when a covered layer ran inside a nested
    function or loop of the forward pass (see `Recording.watch`).
    """
    rec = Recording(self, tape)
    with self.guard(), _patched([(layer, _recording_call(layer, rule, rec))
                                 for layer, rule in self.layers]):
      yield rec
    if rec.refusal:  # Raised here, outside the loop that saw it (see `Recording.watch`).
      raise general.Refused(f"{rec.refusal} (call it outside the loop, or leave its variables "
                            "out of `variables`)", reason=rec.refusal)

  def differentiate(self, loss_fn, batch):
    """Records one batch forward of `loss_fn` and differentiates sum(losses) in ONE backward.

    Only the recorded outputs are differentiated (no variable gradients: the direct formulas
    give them). Returns (rec, output_grads, losses). Eager or traced, any context.
    """
    return self._differentiate(general.user_fn(loss_fn), batch)

  @general.no_autograph
  def _differentiate(self, loss_fn, batch):
    with tf.GradientTape(watch_accessed_variables=False) as tape:
      with self.record(tape) as rec:
        losses = general.check_losses(loss_fn(self.model, batch))
      total = tf.reduce_sum(tf.cast(losses, tf.float32))
    output_grads = tape.gradient(total, rec.outputs,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return rec, output_grads, losses

  def guard(self):
    """Context refusing BatchNormalization with training=True (used around every forward)."""
    return _patched([(layer, _refusing_call(layer, layer.call)) for layer in self._bn_layers])

  def general_gradients(self, loss_fn, batch) -> list:
    """[B, *shape] per general variable, by `general_path` (its own forward passes)."""
    return general.no_autograph(general.gradients)(
        self.model, general.user_fn(loss_fn), batch, self.general_variables, self.general_path,
        self.guard)


class Recording:
  """What one recorded forward pass produced.

  Attributes:
    outputs: the watched tensors; differentiate the loss with respect to them.
    terms: {variable index: [terms.Term, ...]} (several when a layer was called several times).
    joints: [(variable indices, terms.Joint)], for layer calls whose variables are all recorded.
    batch_size: scalar tensor B of the first recorded output (None if nothing was recorded).
    inside: the recorded layers whose calls are running now (innermost last): lets a caller
      tell reads of a layer's variables inside its own call from reads elsewhere (tied weights).
    refusal: '' or why this forward cannot be recorded (raised when `record` ends).
  """

  def __init__(self, recorder, tape):
    self.recorder = recorder
    self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    self._scope = "" if self._graph is None else self._graph.get_name_scope()
    self.refusal = ""
    self.outputs = []
    self.terms = {i: [] for i in recorder.direct_indices}
    self.joints = []
    self.batch_size = None
    self.inside = []
    self._tape = tape

  def watch(self, tensor) -> int:
    """Watches `tensor` on the tape and records it as an output; returns its index.

    Refuses a tensor of another graph than the one the recording started in: a covered layer
    called inside a nested function or loop of the forward pass (a tf.while_loop, tf.cond or
    vectorized_map body, a tf.function inside the model), whose tensors the caller's backward
    pass cannot reach (their gradients would silently be zero, or fail to resolve). The
    refusal is noted in `refusal` and raised when the recording ends: raised inside the loop,
    it would leave TensorFlow's state behind (tf.map_fn does not restore the variable scope's
    caching device on an exception, and a later `strategy.scope()` fails).
    """
    graph = None if isinstance(tensor, tf.__internal__.EagerTensor) else tensor.graph
    if graph is not self._graph or (graph is not None and self._in_pfor_body(tensor)):
      layer = self.inside[-1] if self.inside else None
      name = f"{type(layer).__name__} '{layer.name}'" if layer is not None else "a layer"
      self.refusal = self.refusal or (
          f"per_example: {name} is called inside a nested function or loop of the forward pass "
          "(tf.while_loop, tf.cond, vectorized_map, or a tf.function inside the model), where "
          "its per-example gradients cannot be recorded")
      self.outputs.append(tensor)  # Never differentiated: the recording raises at its end.
      return len(self.outputs) - 1
    if self._tape is not None:
      self._tape.watch(tensor)
    if self.batch_size is None:
      self.batch_size = tf.shape(tensor)[0]
    self.outputs.append(tensor)
    return len(self.outputs) - 1

  def _in_pfor_body(self, tensor) -> bool:
    """Whether `tensor` was made in the body of a `tf.vectorized_map` begun after the recording.

    Traced, pfor builds its loop body in the caller's own graph, under a `loop_body` name scope,
    and then rewrites it: the body's tensors are not those the loss depends on, so their
    gradients would be zero without an error (Keras' `TimeDistributed` over an unknown number
    of steps, a layer that maps a covered layer over its input).
    """
    name = tensor.op.name
    inner = name[len(self._scope):] if name.startswith(self._scope) else name
    return any(_PFOR_BODY.fullmatch(part) for part in inner.split("/")[:-1])

  def add(self, variable, term) -> None:
    """Registers `term` for `variable` (ignored when the variable is not being differentiated)."""
    index = self.recorder.index_of(variable)
    if index is not None and index in self.terms:
      self.terms[index].append(term)

  def add_joint(self, joint) -> None:
    """Registers a `terms.Joint` (ignored unless all its variables are being differentiated)."""
    indices = tuple(self.recorder.index_of(v) for v in joint.variables)
    if all(i is not None and i in self.terms for i in indices):
      self.joints.append((indices, joint))

  def ghost_indices(self) -> list:
    """Direct variables whose statistics use Gram norms and forward dots (not materialised)."""
    method = self.recorder.layer_method
    out = []
    for index, found in self.terms.items():
      if (len(found) != 1 or found[0].gram_norms is None or found[0].batch_sum is None
          or method == "materialize"):
        continue
      if method == "ghost" or found[0].prefers_ghost:
        out.append(index)
    return out

  def variable_gradients(self, index, output_grads, batch_size=None):
    """[B, *shape] float32 per-example gradients of direct variable `index` (materialised)."""
    found = self.terms[index]
    if not found:  # Layer not called by this loss: its gradient is zero.
      size = self.batch_size if batch_size is None else batch_size
      shape = self.recorder.variables[index].shape
      return tf.zeros(tf.concat([[size], shape], 0), tf.float32)
    grads = [term.grads(tf.cast(output_grads[term.output], tf.float32)) for term in found]
    return grads[0] if len(grads) == 1 else tf.add_n(grads)

  def gradients(self, output_grads, batch_size=None) -> dict:
    """{direct variable index: [B, *shape] float32} from the gradients of `outputs`."""
    return {i: self.variable_gradients(i, output_grads, batch_size) for i in self.terms}


def _recording_call(layer, rule, rec):
  def call(inputs, *unused_args, **unused_kwargs):
    rec.inside.append(layer)  # Whose recorded call is running (see `Recording.inside`).
    try:
      return rule.call(layer, inputs, rec)
    finally:
      rec.inside.pop()
  return call


def _training_flag(args, kwargs):
  if "training" in kwargs:
    return kwargs["training"]
  return args[1] if len(args) > 1 else None


def _refusing_call(layer, original):
  def call(*args, **kwargs):
    training = _training_flag(args, kwargs)
    if layer.trainable and training is not None and (not isinstance(training, bool) or training):
      raise general.Refused(
          f"per_example: BatchNormalization layer '{layer.name}' runs with training=True "
          "(batch statistics mix examples, so per-example gradients are ill-defined); set "
          "layer.trainable=False, call it with training=False (inside a functional model, Keras "
          "3 replaces that by the model call's training=True), or use LayerNormalization/"
          "GroupNormalization.")
    return original(*args, **kwargs)
  return call


@contextlib.contextmanager
def _patched(replacements):
  """Temporarily sets `layer.call` for each (layer, call); always restores what was there."""
  done = []
  try:
    for layer, call in replacements:
      done.append((layer, layer.__dict__.get("call", _MISSING)))
      object.__setattr__(layer, "call", call)  # Bypasses Keras attribute tracking.
    yield
  finally:
    for layer, previous in reversed(done):
      if previous is _MISSING:
        object.__delattr__(layer, "call")
      else:
        object.__setattr__(layer, "call", previous)
