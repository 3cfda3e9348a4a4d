"""Every recipe in configs/ loads, validates and trains a few updates through the real builder."""
import importlib

import pytest
import tensorflow as tf

import helpers
from trainer import validation

RECIPES = ["fashion_mnist", "accumulate_cnn", "triplet_vgg", "per_example_stats"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_defaults_validate(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  validation.validate(config)
  assert config.data.source == "idx", "recipes train on the real data by default"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_smoke_trains(tmp_path, name):
  config = importlib.import_module(f"configs.{name}").get_config("smoke,synthetic")
  _, trainer = helpers.build(config, tmp_path)
  trainer.train(tf.constant(2))
  assert int(trainer.optimizer.iterations.numpy()) == 2
  assert int(trainer.micro_batches_seen.numpy()) == 2 * config.accumulation.steps


def test_seed_004_full_vgg16_builds_and_updates(tmp_path):
  """The full-width VGG-16 triplet network: 15M parameters, one update of 2 micro-batches of 1."""
  config = importlib.import_module("configs.triplet_vgg").get_config("full,synthetic")
  assert (config.model, config.batch_size, config.accumulation.steps) == ("vgg16", 1, 128)
  config.accumulation.steps = 2  # 128 micro-steps take ~15 s here; the mechanism is the same.
  _, trainer = helpers.build(config, tmp_path)
  params = sum(int(tf.size(v)) for v in trainer.model.trainable_variables)
  assert params > 14_000_000
  before = [v.numpy().copy() for v in trainer.model.trainable_variables[:1]]
  trainer.train(tf.constant(1))
  assert int(trainer.optimizer.iterations.numpy()) == 1
  assert (trainer.model.trainable_variables[0].numpy() != before[0]).any()


def test_unknown_recipe_arg_is_refused():
  with pytest.raises(ValueError, match=r"config arg \['bogus'\] unknown"):
    importlib.import_module("configs.fashion_mnist").get_config("smoke,bogus")
