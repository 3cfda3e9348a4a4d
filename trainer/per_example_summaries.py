"""Per-example gradient statistics inside training: `config.per_example.every_steps = n`.

Every n updates (updates 0, n, 2n, ...), the trainer hands the update's FIRST micro-batch (the
global batch of `batch_size` examples, every replica's slice) to `write_statistics`, which
  1. in replica context computes this replica's per-example gradients (`trainer.per_example`) and
     the statistics over the global batch with one packed all-reduce plus one all_gather
     (`trainer.grad_stats.replica_statistics`);
  2. in cross-replica context writes TensorBoard scalars `per_example/{gns, diversity, mean_norm,
     mean_cosine, grad_norm, trace}` and histograms `per_example/{norms, cosines}` at the update's
     step.
It runs traced inside the Orbit train function, under a `tf.cond` in cross-replica context, and
costs one extra forward/backward pass of that micro-batch on the updates where it runs. The
weights it sees are those before the update; with k > 1 the other micro-batches are not covered.
"""
import tensorflow as tf

from trainer import base_task
from trainer import grad_stats
from trainer import per_example
from trainer import update

SCALARS = ("gns", "diversity", "mean_norm", "mean_cosine", "grad_norm", "trace")
HISTOGRAMS = ("norms", "cosines")


def replica_statistics_fn(task, model, chunk_size: int):
  """The replica function: `local batch -> {name: tensor}` (replica context, traced)."""
  def replica_fn(local_batch):
    loss_fn = lambda m, b: base_task.weighted_outputs(task, m, b, training=True)[0]
    grads = per_example.per_example_gradients(model, loss_fn, local_batch, chunk_size=chunk_size)
    stats = grad_stats.replica_statistics(grads, model.trainable_variables)
    return {name: stats[name] for name in SCALARS + HISTOGRAMS}
  return replica_fn


def write_statistics(strategy, task, model, batch, step, chunk_size: int) -> tf.Tensor:
  """Computes and writes the statistics of `batch` (cross-replica context, traced)."""
  replica_fn = replica_statistics_fn(task, model, chunk_size)
  stats = update.first_replica(strategy, strategy.run(replica_fn, args=(batch,)))
  # An absolute name scope ("/" at the end) keeps the enclosing tf.cond's scope out of the tags.
  with tf.summary.record_if(True), tf.name_scope("per_example/"):
    for name in SCALARS:
      tf.summary.scalar(name, stats[name], step=step)
    for name in HISTOGRAMS:
      tf.summary.histogram(name, stats[name], step=step)
  return tf.constant(True)
