"""Per-example statistics inside the trainer: written every n updates under `per_example/`."""
import glob

import numpy as np
import pytest
import tensorflow as tf

import helpers


def _events(directory):
  found = {}
  for path in glob.glob(str(directory / "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        found.setdefault(value.tag, []).append((event.step, value))
  return found


@pytest.mark.parametrize("replicas,k", [(1, 1), (2, 2)])
def test_statistics_every_n_updates(tmp_path, replicas, k):
  overrides = {"model": "small_cnn", "per_example.every_steps": 2, "accumulation.steps": k}
  if replicas == 2:
    overrides.update({"strategy": "mirrored", "cpu_replicas": 2})
  _, trainer = helpers.build(helpers.tiny_config(**overrides), tmp_path / "w")
  writer = tf.summary.create_file_writer(str(tmp_path / "tb"))
  with writer.as_default():
    trainer.train(tf.constant(5))
  writer.flush()
  events = _events(tmp_path / "tb")
  for name in ("gns", "diversity", "mean_norm", "mean_cosine"):
    steps = [step for step, _ in events[f"per_example/{name}"]]
    assert steps == [0, 2, 4], (name, steps)
  for name in ("norms", "cosines"):
    assert [step for step, _ in events[f"per_example/{name}"]] == [0, 2, 4]
  cosine = [tf.make_ndarray(v.tensor) for _, v in events["per_example/mean_cosine"]]
  assert all(0.0 < float(c) <= 1.0 for c in cosine)
  diversity = [float(tf.make_ndarray(v.tensor)) for _, v in events["per_example/diversity"]]
  assert all(1.0 / 16 <= d for d in diversity)  # >= 1/B, equality only for identical gradients.
  assert int(trainer.optimizer.iterations.numpy()) == 5
  assert np.isfinite(float(trainer.last_grad_norm.numpy()))


def test_triplet_task_is_refused(tmp_path):
  config = helpers.tiny_config(**{"task": "triplet", "model": "vgg_small",
                                  "data.image_size": 32, "per_example.every_steps": 1})
  with pytest.raises(ValueError, match="`per_example.every_steps` needs one model row per example"):
    helpers.build(config, tmp_path)
