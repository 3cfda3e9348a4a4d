r"""Benchmark: bytes that cross devices per optimizer update, besides the one all-reduce.

  python -m trainer.bench placement [--replicas=2,3] [--k=4] [--json=FILE]

For each replica count R, a fresh process splits the CPU into R logical devices, builds the small
CNN trainer under MirroredStrategy (accumulation k), runs ONE update with TensorFlow's run
metadata on, and reads the partitioned graphs: every `_Send` of a data tensor from one device to
another (`trainer.collectives.device_transfers`). The all-reduce itself is a collective op, not a
`_Send`, so what is counted here is traffic on top of it. One JSON row per R:

  replicas, k, parameter_bytes (4·P),
  gradient_bytes_across_devices   sum of non-scalar float transfers (>= 100 bytes): a gradient
                                  broadcast from one device shows up here as (R-1)·4·P,
  scalar_bytes_across_devices     sum of transfers under 100 bytes (flags, norms, counters),
  unknown_transfers               transfers whose size could not be resolved (should be 0),
  largest_transfer_bytes, transfers.

Eager, host; each R in its own subprocess (logical devices are fixed once TF initialises).
"""
import json
import sys
import tempfile

from absl import flags

from trainer.bench import util as bench_util

FLAGS = flags.FLAGS
flags.DEFINE_list("replicas", ["2", "3"], "Replica counts (logical CPU devices), one row each.")
flags.DEFINE_integer("k", 4, "Micro-steps per update.")
flags.DEFINE_string("json", "", "Write the rows as JSON here.")
flags.DEFINE_integer("case", 0, "Internal: measure this replica count in this process.")

SCALAR_LIMIT_BYTES = 100


def summarize(transfers, parameter_bytes: int) -> dict:
  """Classifies `device_transfers` output into the row's byte columns."""
  known = [t for t in transfers if t.num_bytes is not None]
  scalar = [t for t in known if t.num_bytes < SCALAR_LIMIT_BYTES]
  large = [t for t in known if t.num_bytes >= SCALAR_LIMIT_BYTES]
  return {"parameter_bytes": parameter_bytes,
          "gradient_bytes_across_devices": sum(t.num_bytes for t in large),
          "scalar_bytes_across_devices": sum(t.num_bytes for t in scalar),
          "unknown_transfers": [t.tensor for t in transfers if t.num_bytes is None],
          "largest_transfer_bytes": max([t.num_bytes for t in known], default=0),
          "transfers": len(transfers)}


def _measure(replicas: int, k: int) -> dict:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from trainer import collectives, config_defaults, run  # pylint: disable=g-import-not-at-top
  config = config_defaults.base_config()
  config.data.source = "synthetic"
  config.strategy, config.cpu_replicas = "mirrored", replicas
  config.batch_size, config.accumulation.steps = 8 * replicas, k
  config.eval_batch_size = 8 * replicas
  with tempfile.TemporaryDirectory() as workdir:
    _, trainer, _, _, _ = run.build(config, workdir)
    iterator = iter(trainer.train_dataset)
    transfers = collectives.device_transfers(trainer.train_step, iterator)
  parameter_bytes = sum(int(tf.size(v)) * 4 for v in trainer.model.trainable_variables)
  return dict(replicas=replicas, k=k, **summarize(transfers, parameter_bytes))


def main(argv):
  del argv
  if FLAGS.case:
    bench_util.print_row(_measure(FLAGS.case, FLAGS.k))
    return
  rows = []
  for replicas in map(int, FLAGS.replicas):
    cmd = [sys.executable, "-m", "trainer.bench", "placement", f"--case={replicas}",
           f"--k={FLAGS.k}"]
    rows.append(bench_util.run_row(cmd, f"placement with {replicas} replicas", timeout_s=600))
  print(f"bytes crossing devices per update besides the all-reduce (small CNN, k={FLAGS.k})")
  print(f"{'replicas':>8} {'4·P bytes':>10} {'gradient bytes':>15} {'scalar bytes':>13} "
        f"{'largest':>8} {'unknown':>8}")
  for r in rows:
    print(f"{r['replicas']:>8} {r['parameter_bytes']:>10} {r['gradient_bytes_across_devices']:>15} "
          f"{r['scalar_bytes_across_devices']:>13} {r['largest_transfer_bytes']:>8} "
          f"{len(r['unknown_transfers']):>8}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(rows, f, indent=2)
