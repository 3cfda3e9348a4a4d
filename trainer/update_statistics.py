"""Per-example gradient statistics inside the update's own forward and backward pass.

`config.per_example.every_steps = n` writes, on updates 0, n, 2n, ..., the TensorBoard scalars
`per_example/{gns, diversity, mean_norm, mean_cosine, grad_norm, trace}` and histograms
`per_example/{norms, cosines}`. They come from the ghost path (`trainer.per_example`): no
tensor of size [B, P] is ever formed, and no second forward or backward pass runs.

What they describe. A per-example gradient is g_i = ∇(w_i l_i), the term the update sums (with
unit weights: ∇ l_i). Norms, gradient diversity, the trace of the covariance and the noise scale
cover every example of the update: all k micro-batches on all replicas (the "small batches" of
the noise scale are the R·k per-replica micro-batches, the big one the k·B examples of the
update). Cosines (`mean_cosine`, the `cosines` and `norms` histograms) cover the update's LAST
micro-batch, the one whose activations are still alive when the update's gradient G is known;
cosines are to G, the update's gradient before clipping and without the gradient of Keras
weight regularisers (`kernel_regularizer`...), which act on the weights, not through any
example, so G is Σ g_i / Σ w_i. An activity regulariser is in each g_i as the example's own
share (docs/per_example.md).

How, all traced:

    each micro-step (replica context)      the forward runs recorded (`Recorder.record`); the
                                           ONE backward gives the parameter gradients and the
                                           recorded outputs' gradients; on a statistics update
                                           the per-example squared norms become a [2V+3] vector
                                           of sums that rides in the accumulation buffers
    the update step (replica context)      the same for the last micro-batch; the sums ride in
                                           the update's ONE packed all-reduce; after it, dots of
                                           the last micro-batch's examples with G (one
                                           replica and k = 1: with the norms, as G is then
                                           this batch's own sum); one all_gather of [b, 3]
                                           (norms, cosines, weight not 0)
    the train step (cross-replica)         the summaries, under tf.cond(statistics update)

Added communication: 2V+3 floats in the all-reduce, one all_gather of 3b floats per update.
With n > 1, the work on other updates is the recorded forward (the same arithmetic) and the
gathered zeros; the norms run under `tf.cond` only on statistics updates.
"""
import contextlib

from absl import logging
import tensorflow as tf

from trainer import accumulation
from trainer import base_task
from trainer import errors
from trainer import per_example
from trainer.per_example import conv as per_example_conv
from trainer.per_example import kernels as per_example_kernels

SCALARS = ("gns", "diversity", "mean_norm", "mean_cosine", "grad_norm", "trace")
HISTOGRAMS = ("norms", "cosines")


def _refuse_batch_loss(config, task) -> None:
  """A ConfigError when per-example statistics are asked of a batch-level loss (eager, host):
  the loss of one example alone (an InfoNCE of one pair) is not its share of the batch's, so
  per-example gradients are undefined. In `sum` mode every statistic came out 0 or negative."""
  if int(config.per_example.every_steps) and isinstance(task, base_task.BatchLossTask):
    raise errors.ConfigError(
        f"`per_example.every_steps`={int(config.per_example.every_steps)}: "
        f"{type(task).__name__} has a batch-level loss (base_task.BatchLossTask), whose "
        "per-example gradients are undefined; set it to 0")


class UpdateStatistics:
  """The statistics hook of one trainer; built eagerly with the trainer (see module docstring)."""

  def __init__(self, config, task, model, *, num_replicas: int, accumulation_steps: int):
    self.every = int(config.per_example.every_steps)
    self.enabled = self.every > 0
    if not self.enabled:
      return
    _refuse_batch_loss(config, task)
    # BatchNormalization in training mode (batch statistics mix the examples) is refused by
    # the recorder when it is called so, at the first trace: a layer called with
    # training=False (a subclassed model) or frozen is fine.
    try:
      self.recorder = per_example.Recorder(model, model.trainable_variables,
                                           general_path=config.per_example.general_path)
    except ValueError as e:
      if config.per_example.general_path == "error":
        raise errors.ConfigError(
            f"`per_example.general_path`=error: {getattr(e, 'reason', e)}; allowed: "
            f"{', '.join(per_example.GENERAL_PATHS)}") from None
      raise errors.ConfigError(f"`per_example.every_steps`={self.every}: {e}") from None
    convolutions = [layer.name for layer, _ in self.recorder.layers
                    if isinstance(layer, per_example_conv.COVERED)]
    if convolutions and per_example_kernels.eigen_cpu():
      logging.warning(
          "per_example.every_steps=%d with TensorFlow's oneDNN kernels off (TF 2.20's default "
          "on x86 CPUs without AVX512-VNNI/BF16, AVX-VNNI or AMX): the per-example terms of the "
          "convolutions (%s) run on Eigen's batched matrix products, which makes statistics "
          "updates markedly slower (docs/per_example.md, 'Speed depends on oneDNN'); for speed, "
          "start the job with TF_ENABLE_ONEDNN_OPTS=1", self.every, ", ".join(convolutions))
    self._task = task
    # One replica, one micro-batch: G is this batch's own sum of g_i up to a positive factor
    # (normalisation, clipping), so the dots come with the norms (`self_dots`) and no
    # per-example piece is kept through the all-reduce (the small CNN's second convolution: nine
    # [B, 2048] taps; the run's peak RSS did not move measurably, 53 vs 54 MiB of growth). Not
    # with general-path variables (their examples draw their own dropout masks) nor when the
    # update's gradient is not the terms' sum (`local_sums`).
    self._own_batch_is_update = num_replicas == 1 and accumulation_steps == 1
    self.num_sums = 2 * len(self.recorder.variables) + 3
    self._small_batches = num_replicas * accumulation_steps
    self._num_parameters = sum(int(v.shape.num_elements()) for v in self.recorder.variables)
    self._model = model

  # --- Replica context (traced).
  @contextlib.contextmanager
  def recording(self, tape, batch):
    """Records the forward pass of `batch` for the per-example formulas (yields None when
    disabled). Covered layers whose input is not per example are demoted to the general path.

    A model the recording refuses (e.g. a covered layer called inside a loop of the forward
    pass) is a ConfigError naming `per_example.every_steps` (traced, at the first trace).
    """
    if not self.enabled:
      yield None
      return
    try:
      # A covered layer whose variables the forward reads outside its call (tied weights, a
      # weight penalty in the loss) is demoted to the general path, whose single-example
      # gradients see every use; Keras's own regularisers are read after the recording
      # (`OrbitTrainer.local_sums`): they belong to the batch objective, not to an example.
      with self.recorder.record(tape, batch) as rec:
        yield rec
    except per_example.Refused as e:
      reason = e.reason.rstrip(".")
      raise errors.ConfigError(f"`per_example.every_steps`={self.every}: {reason}; set it to 0 "
                               "for this model") from None

  def recorded_gradients(self, tape, objective, recording, reached):
    """The backward pass when every update computes per-example statistics (replica context).

    Only the recorded layers' outputs and the general-path variables are differentiated: the
    gradient of a recorded layer's variables is the sum of its per-example terms, which the
    statistics compute anyway, so TensorFlow's own kernel gradients (e.g. Conv2DBackpropFilter)
    are not run a second time. A recorded variable is reached by the loss when one of its
    terms' outputs is; `reached` (`trainer.update.ReachedVariables`) learns which are. Returns
    (grads: None for recorded variables and unreached ones, output grads with zeros for None).
    """
    variables = self.recorder.variables
    general = self.recorder.general_indices
    general_grads, output_grads = tape.gradient(
        objective, ([variables[i] for i in general], recording.outputs))
    grads = [None] * len(variables)
    for i, g in zip(general, general_grads):
      grads[i] = g
    found = [g is not None for g in grads]
    for i, terms in recording.terms.items():
      found[i] = any(output_grads[term.output] is not None for term in terms)
    reached.note(found)
    return grads, accumulation.zeros_for_none(output_grads, recording.outputs)

  def active(self, global_step):
    """Whether this update writes statistics (a bool tensor)."""
    return tf.equal(global_step % self.every, 0)

  def _terms(self, rec, output_grads, loss_scale, batch, losses, self_dots=False):
    rows = rec.outputs[0].shape[0] if rec.outputs else None
    if rows is not None and losses.shape[0] is not None and rows != losses.shape[0]:
      raise errors.ConfigError(
          f"`per_example.every_steps` needs one model row per example: "
          f"{type(self._task).__name__} runs the model on {rows} rows for "
          f"{losses.shape[0]} examples; set it to 0")
    general_grads = None
    if self.recorder.general_indices:
      loss_fn = lambda model, b: tf.math.multiply(*base_task.weighted_outputs(
          self._task, model, b, training=True)[:2])
      general_grads = self.recorder.general_gradients(loss_fn, batch)
    scale = None if loss_scale is None else tf.fill(tf.shape(losses), loss_scale)
    return per_example.ghost_norms(rec, output_grads, general_grads=general_grads,
                                   example_scale=scale, batch_size=tf.shape(losses)[0],
                                   self_dots=self_dots)

  def _sums(self, terms, weights):
    """The [2V+3] sums; an example of weight 0 is no example of the update (its loss counts
    nowhere, its g_i is 0): it leaves the count and this small batch's mean gradient. It was
    counted, which diluted mean_norm, mean_cosine, trace and gns (a probe, 2026-12-07)."""
    counted = _counted(weights)
    rows = tf.cast(tf.size(counted), tf.float32)
    # |sum_i g_i / rows|^2 -> |sum_i g_i / counted|^2 (0 when nothing counts: the sum is 0).
    small = terms.mean_grad_sq_norm * tf.square(rows / tf.maximum(tf.reduce_sum(counted), 1.0))
    return per_example.local_sums(terms.sq_norms, small, counted=counted)

  def local_sums(self, active, rec, output_grads, loss_scale, batch, losses, weights, *,
                 terms_sum_is_gradient=False):
    """[2V+3] sums of this replica's micro-batch on a statistics update, else zeros.

    Returns (sums, terms): `terms` (for `norms_and_cosines`) only when every update writes.
    `terms_sum_is_gradient`: the update's gradient is the sum of these terms (no regularisation
    losses; variables read outside their layer's call are on the general path): decided by the
    trainer while tracing.
    """
    if self.every == 1:
      self_dots = (self._own_batch_is_update and terms_sum_is_gradient
                   and not self.recorder.general_indices)
      terms = self._terms(rec, output_grads, loss_scale, batch, losses, self_dots=self_dots)
      return self._sums(terms, weights), terms
    return tf.cond(active, lambda: self._sums(self._terms(rec, output_grads, loss_scale, batch,
                                                          losses), weights),
                   lambda: tf.zeros([self.num_sums])), None

  def norms_and_cosines(self, active, grads, terms, rec, output_grads, loss_scale, batch, losses,
                        weights):
    """[b, 3] norms, cosines to `grads` (the update's G) and whether the example counts (weight
    not 0), of this replica's last micro-batch."""
    counted = _counted(weights)
    def compute(found):
      norms = tf.sqrt(tf.reduce_sum(found.sq_norms, axis=1))
      if found.self_dots is not None:  # G is a positive multiple of this batch's own sum.
        cosines = per_example.cosines(found.self_dots, norms, tf.norm(found.packed_sums))
      else:
        cosines = per_example.cosines(found.dots(grads), norms, tf.linalg.global_norm(grads))
      return tf.stack([norms, cosines, counted], 1)
    if terms is not None:
      return compute(terms)
    return tf.cond(active, lambda: compute(self._terms(rec, output_grads, loss_scale, batch,
                                                       losses)),
                   lambda: tf.zeros([tf.shape(losses)[0], 3]))

  def data_gradient(self, reduced):
    """(G, |G|): the update's normalised gradient before clipping, less the gradient of the
    model's weight regularisers (one per trainable variable, as `reduced.grads`).

    The update's objective holds the regularisers once (`OrbitTrainer.local_sums`), so after
    the normalisation their gradient is added to Σ g_i / Σ w_i unscaled; it is computed here
    from the weights alone, with no communication. Without regularisers: `reduced.grads` (the
    cosines do not depend on clipping) and the pre-clip norm.
    """
    variables = self._model.trainable_variables
    regularised = [i for i, v in enumerate(variables)
                   if getattr(v, "regularizer", None) is not None]
    if not regularised:
      return reduced.grads, reduced.grad_norm
    with tf.GradientTape() as tape:
      penalty = tf.add_n([tf.cast(variables[i].regularizer(variables[i]), tf.float32)
                          for i in regularised])
    penalty_grads = dict(zip(regularised, tape.gradient(
        penalty, [variables[i] for i in regularised])))
    grads = [g if penalty_grads.get(i) is None else g - tf.cast(penalty_grads[i], g.dtype)
             for i, g in enumerate(reduced.unclipped)]
    return grads, tf.linalg.global_norm(grads)

  def statistics(self, sums, grad_norm, weight_sum):
    """The scalar statistics from the reduced sums; `grad_norm` of the normalised update."""
    count = sums[-2]
    grad_sq = tf.square(grad_norm * weight_sum / tf.maximum(count, 1.0))  # |Σ g_i / count|^2.
    stats = per_example.statistics_from_sums(sums, grad_sq,
                                             num_small_batches=self._small_batches,
                                             num_parameters=self._num_parameters)
    return tf.stack([stats[name] for name in SCALARS if name != "mean_cosine"])

  # --- Cross-replica context (traced).
  def write(self, active, scalars, gathered, step) -> None:
    """TensorBoard summaries of one update, when `active`, at `step`: the count of updates
    with this one, where TensorBoard shows the update's loss."""
    def write():
      named = dict(zip([n for n in SCALARS if n != "mean_cosine"], tf.unstack(scalars)))
      counted = gathered[:, 2]  # Examples of weight 0 are left out (a cosine to 0 is none).
      named["mean_cosine"] = (tf.reduce_sum(gathered[:, 1] * counted)
                              / tf.maximum(tf.reduce_sum(counted), 1.0))
      kept = tf.boolean_mask(gathered[:, :2], counted > 0.0)
      # An absolute name scope ("/" at the end) keeps the tf.cond's scope out of the tags.
      with tf.summary.record_if(True), tf.name_scope("per_example/"):
        for name in SCALARS:
          tf.summary.scalar(name, named[name], step=step)
        tf.summary.histogram("norms", kept[:, 0], step=step)
        tf.summary.histogram("cosines", kept[:, 1], step=step)
      return tf.constant(True)
    tf.cond(active, write, lambda: tf.constant(False))


def _counted(weights):
  """[b] float32: 1 for an example that counts (weight not 0), else 0."""
  return tf.cast(tf.not_equal(tf.reshape(weights, [-1]), 0.0), tf.float32)
