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
are refused (batch statistics mix the examples). A covered layer whose input is not per example
(`examples_axis.py`) or whose variables are read outside its call (`reads.py`) is demoted to the
general path while recording: its terms are dropped and `general_indices` grows, so read the
recorder's index lists after the forward.

Context: Python-level patching, active while the `with` block runs: eagerly, or while tracing
inside `tf.function`, in replica or cross-replica context; it never communicates. Under
MirroredStrategy replica functions take turns between sync points, and a forward pass has none,
so replicas never see each other's patches; keep collectives out of the `with` block. The
recorded tensors belong to the current trace: use `rec` in the same function (or replica
function) that recorded it.
"""
import contextlib
import re
import weakref

from absl import logging
import keras
import tensorflow as tf

from trainer import autograph
from trainer.per_example import examples_axis
from trainer.per_example import general
from trainer.per_example import layers
from trainer.per_example import patching
from trainer.per_example import reads

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


_WARNED = weakref.WeakSet()  # Layers whose demotion was logged (once per process).
LAYER_METHODS = ("auto", "materialize", "ghost")


def keys(v) -> tuple:
  """The identities a variable is known by: the object the caller holds and the backend
  variable behind a Keras variable (callers and layers may hold either)."""
  return tuple(dict.fromkeys((id(v), id(general.unwrap(v)))))


def _find(mapping, v, default=None):
  return next((mapping[k] for k in keys(v) if k in mapping), default)


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
    all_layers = general.flat_layers(model)
    looped = {}
    for wrapper in all_layers:
      if _loops_over_its_layers(wrapper):
        for inner in general.flat_layers(wrapper)[1:]:
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
    self._set_direct(covered)
    self.demoted = []  # (layer, why) moved to the general path while recording, in order.
    self._bn_layers = [l for l in all_layers if isinstance(l, _BN_TYPES)]
    if general_path == "error" and self.general_indices:
      raise general.refusal([
          f"{variable_name(v)} ({_find(reasons, v, 'not reached through a Keras layer')})"
          for v in self.general_variables])

  def _set_direct(self, covered) -> None:
    self.direct_indices = sorted(covered)
    self.general_indices = [i for i in range(len(self.variables)) if i not in covered]
    self.general_variables = [self.variables[i] for i in self.general_indices]

  def index_of(self, variable):
    """The index of `variable` in `variables` (held as a Keras or a backend variable), or None."""
    return _find(self._index, variable)

  def indices_of(self, layer, rule) -> list:
    return [i for i in map(self.index_of, layers.layer_variables(layer, rule)) if i is not None]

  def demote(self, layer, problem) -> list:
    """Moves `layer`'s variables to the general path for good (this recorder's later forwards
    call it unrecorded); returns their indices. Logs why, once per layer."""
    rule = next((r for l, r in self.layers if l is layer), None)
    if rule is None:
      return []
    self.layers = [(l, r) for l, r in self.layers if l is not layer]
    self.demoted.append((layer, problem))
    still = {i for l, r in self.layers for i in self.indices_of(l, r)}
    moved = [i for i in self.indices_of(layer, rule) if i not in still]
    self._set_direct(set(self.direct_indices) - set(moved))
    if layer not in _WARNED:
      _WARNED.add(layer)
      logging.warning("per_example: %s '%s': %s; its variables take the general path "
                      "(general_path=%s)", type(layer).__name__, layer.name, problem,
                      self.general_path)
    return moved

  @contextlib.contextmanager
  def record(self, tape, batch=None):
    """Records the forward pass run inside the block; yields the `Recording`.

    `tape`: the GradientTape that will differentiate the loss (each output is watched on it).
    `batch`: the batch the forward reads (any nest of tensors); with it, covered layers whose
    input's axis 0 is not the batch's example axis are demoted to the general path
    (`examples_axis.py`). A covered layer whose variables are read outside its recorded call
    (tied weights, a weight penalty in the loss; `reads.py`) is demoted after the forward: its
    terms would miss those uses. (Keras's own weight regularisers, read by `model.losses`,
    belong to the batch objective: read them after the block.)
    Raises `general.Refused` at the end of the block when a covered layer ran inside a nested
    function or loop of the forward pass (see `Recording.watch`), when its variables were read
    but its call was not recorded (a `tf.function` already traced around the model or the
    loss), or for a demotion under general_path='error'.
    """
    rec = Recording(self, tape, batch)
    with self.guard(), reads.trainable_reads() as read_ids, reads.outside_calls(
        self, rec) as outside, patching.inner_tapes() as rec.open_tapes, patching.patched(
            [(layer, patching.recording_call(layer, rule, rec)) for layer, rule in self.layers]):
      yield rec
      read_ids = read_ids()
    for layer, paths in outside.values():
      rec.demote(layer, f"{', '.join(sorted(set(paths)))} read outside its call (tied "
                 "weights, or a regulariser in the loss)")
    if rec.refusal:  # Raised here, outside the loop that saw it (see `Recording.watch`).
      raise general.Refused(rec.refusal + rec.advice, reason=rec.refusal)
    unrecorded = reads.unrecorded(self, rec, read_ids)
    if unrecorded:
      raise general.Refused(unrecorded)

  def differentiate(self, loss_fn, batch):
    """Records one batch forward of `loss_fn` and differentiates sum(losses) in ONE backward.

    Only the recorded outputs are differentiated (no variable gradients: the direct formulas
    give them). Returns (rec, output_grads, losses). Eager or traced, any context. Call
    `scout` first when eager (the callers in this package do).
    """
    return self._differentiate(autograph.like_caller(loss_fn), batch)

  def scout(self, loss_fn, batch) -> None:
    """Eager only: demotes covered calls whose input does not depend on the batch (traces the
    forward once in a scratch graph; see `examples_axis.scout`). No-op when traced."""
    examples_axis.scout(self, loss_fn, batch)

  @autograph.library
  def _differentiate(self, loss_fn, batch):
    with tf.GradientTape(watch_accessed_variables=False) as tape:
      with self.record(tape, batch) as rec:
        losses = general.check_losses(loss_fn(self.model, batch), batch)
        rec.check_losses(losses)
      total = tf.reduce_sum(tf.cast(losses, tf.float32))
    output_grads = tape.gradient(total, rec.outputs,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return rec, output_grads, losses

  def guard(self):
    """Context refusing BatchNormalization with training=True (used around every forward)."""
    return patching.patched([(layer, patching.refusing_call(layer, layer.call))
                             for layer in self._bn_layers])

  def general_gradients(self, loss_fn, batch) -> list:
    """[B, *shape] per general variable, by `general_path` (its own forward passes; see
    `general.py` for where `vectorized_map` runs as `loop`)."""
    return autograph.library(general.gradients)(
        self.model, autograph.like_caller(loss_fn), batch, self.general_variables,
        self.general_path, self.guard)


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

  def __init__(self, recorder, tape, batch=None):
    self.recorder = recorder
    self.batch_axis = examples_axis.BatchAxis(batch)
    self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    self._scope = "" if self._graph is None else self._graph.get_name_scope()
    self.refusal = ""
    self.advice = ""  # For the library's callers, after `refusal`.
    self.outputs = []
    self.terms = {i: [] for i in recorder.direct_indices}
    self.joints = []
    self.batch_size = None
    self.inside = []
    self.open_tapes = []  # Tapes opened inside the recorded forward (`patching.inner_tapes`).
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
      self.advice = self.advice or (" (call it outside the loop, or leave its variables out of "
                                    "`variables`)")
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

  def demote(self, layer, problem) -> None:
    """Sends `layer` to the general path (see `Recorder.demote`) and forgets its terms."""
    moved = set(self.recorder.demote(layer, problem))
    for i in moved:
      self.terms.pop(i, None)
    self.joints = [(indices, joint) for indices, joint in self.joints
                   if not moved.intersection(indices)]
    if moved and self.recorder.general_path == "error" and not self.refusal:
      self.refusal = general.demotion_refusal(layer, problem)
      self.advice = " (use general_path='loop' or 'vectorized_map')"

  def check_losses(self, losses) -> None:
    """Call inside `record` with the forward's [B] per-example losses: when they mix the
    examples (`examples_axis.BatchAxis.losses_problem`), every recorded layer is demoted to
    the general path, whose single-example forwards define each example's gradient."""
    problem = self.batch_axis.losses_problem(losses)
    for layer, _ in list(self.recorder.layers) if problem else ():
      self.demote(layer, problem)

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
