"""Every recipe in configs/ loads, validates and trains a few updates through the real builder;
the shipped examples beyond Fashion-MNIST train under Mirrored(2) with k=4 and resume bitwise."""
import importlib

import numpy as np
import pytest
import tensorflow as tf

import helpers
from trainer import errors
from trainer import config_defaults
from trainer import validation
from trainer.tasks import npz

FASHION_RECIPES = ["fashion_mnist", "accumulate_cnn", "triplet_vgg", "per_example_stats",
                   "contrastive"]
RECIPES = FASHION_RECIPES + ["text_transformer", "npz_arrays", "chi_square"]


def _npz(path):
  """A small `.npz` in keras.datasets layout: 8x8 'images', 3 classes."""
  rng = np.random.RandomState(0)
  y_train, y_test = rng.randint(0, 3, 256), rng.randint(0, 3, 64)
  centers = rng.normal(size=(3, 8, 8))
  noisy = lambda y: (centers[y] + 0.5 * rng.normal(size=(len(y), 8, 8))).astype(np.float32)
  np.savez(path, x_train=noisy(y_train), y_train=y_train, x_test=noisy(y_test), y_test=y_test)
  return str(path)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_defaults_validate(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  validation.validate(config)
  if name in FASHION_RECIPES:
    assert config.data.source == "idx", "recipes train on the real data by default"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_smoke_trains(tmp_path, name):
  config = importlib.import_module(f"configs.{name}").get_config("smoke,synthetic")
  if name == "npz_arrays":
    config.data.path = _npz(tmp_path / "mine.npz")
  _, trainer = helpers.build(config, tmp_path / "w")
  trainer.train(tf.constant(2))
  assert int(trainer.optimizer.iterations.numpy()) == 2
  assert int(trainer.micro_batches_seen.numpy()) == 2 * config.accumulation.steps


@pytest.mark.parametrize("name", ["text_transformer", "npz_arrays"])
def test_shipped_example_trains_under_mirrored_with_k4_and_resumes_bitwise(tmp_path, name):
  overrides = ["strategy=mirrored", "cpu_replicas=2", "accumulation.steps=4",
               "deterministic=True", "steps_per_loop=2", "checkpoint_every=2", "eval_every=100",
               "export_at_end=False"]
  if name == "npz_arrays":
    overrides.append(f"data.path={_npz(tmp_path / 'mine.npz')}")
  recipe = f"configs/{name}.py:smoke"
  helpers.assert_resume_is_bitwise(tmp_path, recipe, *overrides)


def test_npz_recipe_without_a_path_is_one_line(tmp_path):
  out = helpers.run_cli(tmp_path, "configs/npz_arrays.py:smoke", timeout=120)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1] == (
      "microstep: error: `data.path` is empty; set it to your .npz file, e.g. "
      "--config.data.path=/data/mine.npz")


def _npz_with(path, **changes):
  """The small `.npz` above with some arrays replaced."""
  with np.load(_npz(path)) as f:
    arrays = dict(f)
  arrays.update(changes)
  np.savez(path, **arrays)
  return str(path)


@pytest.mark.parametrize("changes, message", [
    (dict(x_train=np.zeros((0, 8, 8), np.float32), y_train=np.zeros((0,), np.int64)),
     "y_train is empty"),
    (dict(x_train=np.zeros((255, 8, 8), np.float32)), "x_train has 255 rows but y_train has 256"),
    (dict(y_test=np.full((64,), 0.5, np.float32)), "y_test must be integers >= 0"),
    (dict(y_test=np.full((64,), -1)), "y_test must be integers >= 0"),
    (dict(y_test=np.full((64,), 5)), "y_test span [0, 5] but the classes are 0..2"),
    (dict(x_test=np.zeros((64, 7, 8), np.float32)),
     "x_test has examples of shape (7, 8); the training examples are (8, 8)"),
])
def test_every_split_of_an_npz_is_checked_before_training(tmp_path, changes, message):
  """A bad test split used to surface after training (or never: float labels were truncated)."""
  config = importlib.import_module("configs.npz_arrays").get_config("smoke")
  config.data.path = _npz_with(tmp_path / "mine.npz", **changes)
  with pytest.raises(errors.DataError, match=None) as raised:
    npz.NpzClassification(config)
  assert message in str(raised.value)
  assert "\n" not in str(raised.value)


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


def test_a_misspelt_field_of_a_microstep_group_is_refused_and_a_users_own_group_is_not(caplog):
  """In a config file ml_collections takes `per_example.every_step = 1` silently, and the
  statistics stayed off (a probe, 2026-12-06). Fields of microstep's own groups are checked; a
  task's own group is the user's; a top-level name close to a field is a warning."""
  config = importlib.import_module("configs.fashion_mnist").get_config("smoke")
  config.my_task = {"vocab": 10}  # The user's own group: no error, no warning.
  validation.validate(config)
  config.per_example.every_step = 1
  with pytest.raises(validation.ConfigError, match=(
      r"^`per_example.every_step` is not a field \(did you mean `per_example.every_steps`\?\); "
      r"allowed in per_example: every_steps, general_path$")):
    validation.validate(config)
  del config.per_example["every_step"]
  assert "not a field" not in caplog.text
  config.learning_rate = 0.1
  config.batchsize = 64
  validation.validate(config)
  assert "`batchsize` is not a field microstep reads (did you mean `batch_size`?)" in caplog.text
  assert "`learning_rate` is not a field microstep reads (did you mean " \
         "`optimizer.learning_rate`?)" in caplog.text


def test_a_config_missing_a_group_or_a_field_of_one_is_one_line():
  """A get_config that deleted or replaced one of microstep's groups failed later with a
  KeyError traceback (a probe, 2026-12-08)."""
  from trainer import errors  # pylint: disable=g-import-not-at-top
  from trainer import validation  # pylint: disable=g-import-not-at-top
  without_group = config_defaults.base_config()
  del without_group["optimizer"]
  with pytest.raises(errors.ConfigError, match=r"^the config lacks `optimizer`; start get_config "
                     r"from `config = config_defaults\.base_config\(\)`"):
    validation.validate(without_group)
  without_field = config_defaults.base_config()
  del without_field.optimizer["weight_decay"]
  with pytest.raises(errors.ConfigError, match=r"^the config lacks `optimizer\.weight_decay`;"):
    validation.validate(without_field)
  not_a_group = config_defaults.base_config()
  del not_a_group["optimizer"]
  not_a_group.optimizer = "adam"
  with pytest.raises(errors.ConfigError, match=r"^`optimizer`='adam' must be a group of fields "
                     r"\(beta_1, beta_2, decay, "):
    validation.validate(not_a_group)
  validation.validate(config_defaults.base_config())
