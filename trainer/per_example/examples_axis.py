"""Whether axis 0 of a covered layer's input is the example axis of the batch.

The direct formulas (`layers.py`, `conv.py`) read row i of a layer's input and of its output
gradient as example i's. That holds for a layer applied to the examples (x = f(batch), row by
row), not for one applied to something else:
* a tensor that does not depend on the batch: a position Embedding over `arange(T)`, a Dense on
  a learned query or on `tf.ones([1, F])`; its output is broadcast over the examples later;
* a tensor whose axis 0 is another axis: time-major [T, B, F], or [B*T, F] after a reshape.
Left alone, such a layer gets silently wrong per-example gradients when the leading size happens
to equal B (and a wrong shape otherwise); the sum over the examples, the update, is right.

`BatchAxis(batch).problem(x)` tells, while a recorded forward runs, why `x` cannot be read per
example ('' when it can, as far as can be told):
* statically: `x.shape[0]` known and different from the batch's static size;
* traced (x a graph tensor): where the batch's examples are in x, by `labelling.Labeller`: a
  walk of the graph back from x to the batch's tensors that applies `axis_rules` op by op
  (through nested function graphs, branches and loops). A problem when x does not depend on
  the values of the batch, when its examples are on another axis (time-major [T, B, F], also
  with T == B), and when its rows are the examples in another order (x[::-1], a gather, sort
  or shuffle of the rows) or mixed across them (x - mean(x, 0), a cumsum over the examples;
  also any op `axis_rules` has no rule for);
* a tf.SparseTensor or tf.RaggedTensor input (no formula reads one).
What it cannot see: a batch-independent or moved input run eagerly (eager tensors keep no
history). For the eager case `scout` traces the forward once, in a scratch graph that never
runs, so that the recorder learns which calls to demote before the eager forward.
`losses_problem(losses)` asks the same of the per-example losses: when they mix the examples
(in the loss, or in a layer after the recorded ones), every recorded layer is demoted.
Rows moved and moved back (x[::-1] then [::-1] again) stay moved for every layer after them:
those layers take the general path too (exact, slower).
The recorder demotes the layers found to the general path (`recording.py`).

Context: Python only (reads graph structure; creates no ops), eager or while tracing.
"""
import weakref

from absl import logging
import keras
import tensorflow as tf

from trainer import autograph
from trainer.per_example import axis_rules
from trainer.per_example import general
from trainer.per_example import labelling


def _leaves(batch, expand):
  return [t for t in tf.nest.flatten(batch, expand_composites=expand)
          if tf.is_tensor(t) or isinstance(t, tf.RaggedTensor)]


def static_size(batch):
  """The batch's static number of examples (None when unknown or when there is no batch)."""
  for t in _leaves(batch, expand=False):
    if t.shape.rank:
      return t.shape[0]
  return None


class BatchAxis:
  """Answers `problem(x)` for the tensors of one recorded forward pass of `batch`."""

  def __init__(self, batch):
    self.size = None if batch is None else static_size(batch)
    tensors = [] if batch is None else _leaves(batch, expand=False)
    self._rows = next((t for t in tensors if tf.is_tensor(t)
                       and not isinstance(t, tf.SparseTensor) and t.shape.rank), None)
    components = [] if batch is None else _leaves(batch, expand=True)
    # The components of a ragged or sparse batch tensor (values, row splits, indices) have no
    # axis of B examples; they count as in order, without a size, so that `to_tensor()` of them
    # is (reading such a component directly meets the rows check).
    seeds = {t.ref(): axis_rules.Examples(0, 1, None) if t.shape.rank else None
             for t in components}
    seeds.update({t.ref(): axis_rules.Examples(0, 1, t.shape[0]) if t.shape.rank else None
                  for t in tensors if isinstance(t, tf.Tensor)})
    self._has_batch = bool(seeds)
    self._labeller = labelling.Labeller(seeds)

  def problem(self, x) -> str:
    """'' when axis 0 of `x` can be taken as the example axis; else why not (one phrase)."""
    if isinstance(x, (tf.SparseTensor, tf.RaggedTensor)):  # No formula reads them.
      return f"its input is a tf.{type(x).__name__}"
    if not tf.is_tensor(x) or not self._has_batch:
      return ""
    if x.shape.rank == 0:
      return "its input is a scalar"
    rows = x.shape[0] if x.shape.rank is not None else None
    if rows is not None and self.size is not None:
      if rows != self.size:
        return (f"its input's axis 0 has {rows} rows for {self.size} examples (not the "
                "example axis)")
      if rows == 1:  # One example: every row is its own, whatever the input.
        return ""
    if isinstance(x, (tf.Variable, keras.Variable)):
      return "its input is a variable (it does not depend on the batch)"
    parts = tf.nest.flatten(x, expand_composites=True)  # A RaggedTensor's components.
    if any(isinstance(t, tf.__internal__.EagerTensor) for t in parts):
      return ""  # No history to read (see `scout`).
    labels = [self._labeller.label(t) for t in parts]
    if all(axis is None for axis, _ in labels):
      return ("its input does not depend on the values of the batch (it is shared by the "
              "examples, or broadcast over them)")
    for label, via in labels:
      if label == axis_rules.MOVED:
        return f"its input holds the batch's rows in another order or mixed (after {via})"
      if label is not None and not label.in_order:
        where = (f"on axis {label.axis}" if label.inner == 1 else
                 f"interleaved along axis {label.axis}")
        return f"its input's axis 0 is not the example axis: the examples are {where} " \
               f"(after {via})"
    return ""

  def losses_problem(self, losses) -> str:
    """'' when row i of the traced per-example `losses` is example i's own loss, as far as the
    graph tells; else why not (one phrase). Losses that mix the examples (weights from a
    softmax over the batch, `l - mean(l)`) or a model whose later layers do (`x - mean(x, 0)`)
    make row i of every recorded output gradient depend on the other examples, so no direct
    formula gives example i's gradient, not even in layers before the mixing."""
    if (not self._has_batch or not isinstance(losses, tf.Tensor)
        or isinstance(losses, tf.__internal__.EagerTensor)):
      return ""
    if self.size == 1:  # One example: its loss is its own, whatever the graph does to axis 0
      return ""         # (traced at B=1, Keras squeezes it away in `x + y` and RNNs: a probe).
    label, via = self._labeller.label(losses)
    if label is None or (label != axis_rules.MOVED and label.in_order):
      return ""
    return (f"the per-example losses depend on other examples' values (after {via}); per-example "
            "gradients follow the single-example forward")

  def checked(self, x, name):
    """`x`, with a run-time check that its axis 0 has as many rows as the batch when either
    size is known only at run time (traced with a dynamic batch size; the static check of
    `problem` could not tell). A mismatch fails the step with one clear line instead of a
    wrong shape or a ConcatOp error in the statistics."""
    if (self._rows is None or not isinstance(x, tf.Tensor)
        or isinstance(x, tf.__internal__.EagerTensor)
        or (x.shape.rank and x.shape[0] is not None and self.size is not None)):
      return x
    check = tf.debugging.assert_equal(
        tf.shape(x)[0], tf.shape(self._rows)[0], message=(
            f"per_example: {name}: axis 0 of its input is not the example axis (rows != batch "
            "size); give the batch a static size when tracing (the layer then takes the "
            "general path)"))  # (No quotes: the run-time message escapes them.)
    with tf.control_dependencies([check]):
      return tf.identity(x)


def scout(recorder, loss_fn, batch) -> None:
  """Eagerly, before an eager recorded forward: demotes the covered calls whose input does not
  depend on the batch, found by tracing `loss_fn(model, batch)` recorded in a scratch graph
  (traced, never run: no variable, random state or metric changes).

  What a scout found is kept per (model, loss_fn, batch signature) while both live, so repeated
  eager calls pay for the trace once (it costs about one eager forward and backward of a small
  Transformer). No-op when traced (the recording sees the graph itself), with one example, or
  when nothing is recorded. An error while tracing (a loss that only runs eagerly) skips the
  scout; the eager forward then raises its own errors.
  """
  if not tf.executing_eagerly() or not recorder.layers or static_size(batch) == 1:
    return
  try:
    specs = tf.nest.map_structure(tf.type_spec_from_value, batch)
  except (TypeError, ValueError):
    return
  found = _cached(recorder.model, loss_fn, repr(specs))
  if found is None:
    found = _trace(recorder, autograph.like_caller(loss_fn), specs)
    _cache(recorder.model, loss_fn, repr(specs), found)
  else:
    for layer, problem in found:
      recorder.demote(layer, problem)
  if recorder.general_path == "error" and found:
    raise general.Refused(general.demotion_refusal(*found[0]))


def _trace(recorder, loss_fn, specs) -> list:
  """The (layer, why) demoted by one recorded trace of the forward (see `scout`)."""
  before = len(recorder.demoted)

  def forward(b):
    with recorder.record(None, b) as rec:
      rec.check_losses(general.check_losses(loss_fn(recorder.model, b), b))
    return tf.constant(0.0)
  try:
    tf.function(forward, autograph=False).get_concrete_function(specs)
  except Exception as e:  # pylint: disable=broad-except
    # Traced code may refuse what runs eagerly (tf.map_fn is a Python loop there): only the
    # demotions are kept.
    logging.debug("per_example: scout trace failed (%s); eager forward goes unchecked", e)
  return recorder.demoted[before:]


# model -> {loss_fn -> {signature: [(layer, why)]}}, all weakly held (layers by weakref).
_SCOUTED = weakref.WeakKeyDictionary()


def _cached(model, loss_fn, signature):
  try:
    found = _SCOUTED.get(model, {}).get(loss_fn, {}).get(signature)
  except TypeError:  # Not weakly referenceable: no cache.
    return None
  return None if found is None else [(layer(), problem) for layer, problem in found]


def _cache(model, loss_fn, signature, found) -> None:
  try:
    by_fn = _SCOUTED.setdefault(model, weakref.WeakKeyDictionary())
    by_fn.setdefault(loss_fn, {})[signature] = [(weakref.ref(layer), problem)
                                                 for layer, problem in found]
  except TypeError:
    pass
