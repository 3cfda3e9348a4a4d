r"""Benchmark: how far the accumulated gradient is from the full batch's, plain vs gradcache.

  python -m trainer.bench gradient_error [--task=histogram_chi_square] [--examples=128]
                                         [--ks=1,4,16] [--seeds=5] [--json=FILE]

For a batch-level loss, each update holds `--examples` examples as k micro-batches of
examples/k. The trainer runs ONE real update with plain SGD at learning rate 1 (no momentum, no
clipping), so the applied gradient is g = θ0 - θ1, in `sum` mode (averaging micro-batch
gradients) and in `gradcache` mode. The full-batch gradient g_full is ∇ batch_loss of all the
update's representations, taken directly with one tape at θ0. Reported per (mode, k): the
relative error |g - g_full| / |g_full| and the cosine between them, mean over `--seeds` updates
(different data). Eager, host, one process, default strategy.
"""
import json

from absl import flags
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_string("task", "histogram_chi_square", "A batch-level loss task.")
flags.DEFINE_integer("examples", 128, "Examples per update (k micro-batches of examples/k).")
flags.DEFINE_list("ks", ["1", "4", "16"], "Micro-steps per update.")
flags.DEFINE_integer("seeds", 5, "Updates (seeds) to average over.")
flags.DEFINE_string("json", "", "Write the rows as JSON here.")


def _applied_and_full_gradient(task_name, mode, k, seed, workdir):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import base_task, config_defaults, data, run, sources  # pylint: disable=g-import-not-at-top
  config = config_defaults.base_config()
  config.task, config.model, config.seed = task_name, "mlp", seed
  config.data.source, config.triplet.embedding_dim = "synthetic", 8
  config.accumulation.mode, config.accumulation.steps = mode, k
  config.batch_size = FLAGS.examples // k
  config.optimizer.name, config.optimizer.learning_rate = "sgd", 1.0
  config.train_steps = config.steps_per_loop = 1
  _, trainer, _, _, _ = run.build(config, workdir)
  variables = trainer.model.trainable_variables
  before = [v.numpy().copy() for v in variables]
  source = sources.as_source(trainer.task.train_data(), "train_data()")
  batch = data.batch_at(source, tf.range(FLAGS.examples, dtype=tf.int64), seed=seed,
                        shuffle=True)
  features = {n: t for n, t in batch.items() if n != sources.VALID_KEY}
  with tf.GradientTape() as tape:
    reps = trainer.task.represent(trainer.model, features, training=True)
    loss = base_task.batch_loss_of(trainer.task, reps, batch[sources.VALID_KEY]).loss
  full = np.concatenate([np.ravel(g) for g in tape.gradient(loss, variables)])
  trainer.train(tf.constant(1))
  applied = np.concatenate([np.ravel(b - v.numpy()) for b, v in zip(before, variables)])
  return applied, full


def main(argv):
  del argv
  import tempfile  # pylint: disable=g-import-not-at-top
  rows = []
  for mode in ("sum", "gradcache"):
    for k in map(int, FLAGS.ks):
      errors, cosines = [], []
      for seed in range(FLAGS.seeds):
        with tempfile.TemporaryDirectory() as workdir:
          applied, full = _applied_and_full_gradient(FLAGS.task, mode, k, seed, workdir)
        errors.append(np.linalg.norm(applied - full) / np.linalg.norm(full))
        cosines.append(applied @ full / (np.linalg.norm(applied) * np.linalg.norm(full)))
      rows.append({"task": FLAGS.task, "mode": mode, "k": k,
                   "micro_batch": FLAGS.examples // k, "relative_error": float(np.mean(errors)),
                   "cosine": float(np.mean(cosines))})
  print(f"{FLAGS.task}: {FLAGS.examples} examples per update, mean over {FLAGS.seeds} updates")
  print(f"{'mode':<10} {'k':>3} {'micro-batch':>11} {'|g - g_full|/|g_full|':>22} {'cosine':>8}")
  for r in rows:
    print(f"{r['mode']:<10} {r['k']:>3} {r['micro_batch']:>11} {r['relative_error']:>22.2e} "
          f"{r['cosine']:>8.4f}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(rows, f, indent=2)
