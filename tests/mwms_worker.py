"""One worker of the two-process MultiWorkerMirroredStrategy tests (run by test_multi_worker.py).

usage: python tests/mwms_worker.py INDEX PORT0,PORT1 OUT_DIR K OPTIMIZER [TASK]
(TASK: a batch-level loss task, trained with accumulation.mode=gradcache)
Trains 3 updates of the tiny config under multi_worker_mirrored on 127.0.0.1 and writes
OUT_DIR/worker{INDEX}.npz with the initial and final weights, the optimizer variables and the
number of collective all-reduce ops in the traced update and micro-step; with TASK, also the
evaluation of the final weights (`eval_<output>`).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  index, ports, out_dir, k, optimizer = sys.argv[1:6]
  batch_task = sys.argv[6] if len(sys.argv) > 6 else ""
  os.environ["TF_CONFIG"] = json.dumps({
      "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports.split(",")]},
      "task": {"type": "worker", "index": int(index)}})
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import helpers  # pylint: disable=g-import-not-at-top
  from trainer import collectives  # pylint: disable=g-import-not-at-top
  from test_accumulation import OPTIMIZERS  # pylint: disable=g-import-not-at-top

  overrides = dict(OPTIMIZERS[optimizer])
  overrides.update({"accumulation.steps": int(k), "optimizer.global_clipnorm": 0.3,
                    "optimizer.warmup_steps": 2, "optimizer.decay": "cosine",
                    "strategy": "multi_worker_mirrored", "peer_timeout_s": 60})
  if batch_task:
    overrides.update({"task": batch_task, "accumulation.mode": "gradcache",
                      "triplet.embedding_dim": 8})
  config = helpers.tiny_config(**overrides)
  from trainer import run  # pylint: disable=g-import-not-at-top
  strategy, trainer, evaluator, _, eval_steps = run.build(config, os.path.join(out_dir, "workdir"))
  initial, _ = helpers.snapshot(strategy, trainer)
  iterator = iter(trainer.train_dataset)
  update_graph = tf.function(trainer.train_step).get_concrete_function(iterator)
  micro_graph = None
  if trainer.buffers is not None and not batch_task:
    micro_graph = tf.function(lambda it: strategy.run(trainer.micro_step, args=(next(it),))
                              ).get_concrete_function(iterator)
  trainer.train(tf.constant(3))
  weights, slots = helpers.snapshot(strategy, trainer)
  evaluation = {}
  if batch_task:  # The batch loss over the representations of both workers' examples.
    evaluation = {f"eval_{name}": float(value) for name, value in
                  evaluator.evaluate(tf.constant(eval_steps, tf.int32)).items()}
  np.savez(os.path.join(out_dir, f"worker{index}.npz"),
           initial=np.array(initial, dtype=object), weights=np.array(weights, dtype=object),
           slots=np.array(slots, dtype=object),
           iterations=int(trainer.optimizer.iterations.numpy()),
           update_reduces=collectives.collective_reduce_ops(update_graph),
           micro_reduces=-1 if micro_graph is None else collectives.collective_reduce_ops(micro_graph),
           **evaluation)


if __name__ == "__main__":
  main()
