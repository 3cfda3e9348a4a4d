"""Config validation: every field checked before any compute, one line naming field and allowed values.

`validate(config)` runs eagerly on the host before the strategy, data or model exist;
`validate_replicas(config, num_replicas)` runs right after the strategy is built.
"""
import difflib
import math

from absl import logging
import ml_collections

from trainer import config_defaults
from trainer import errors
from trainer import optimizers
from trainer import strategies

MODES = ("train", "eval", "train_and_eval", "continuous_eval", "export")
TRAINING_MODES = ("train", "train_and_eval")  # The others only read checkpoints.
EVALUATING_MODES = ("train_and_eval", "eval", "continuous_eval")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")


ConfigError = errors.ConfigError


def _choice(config, field, allowed):
  value = config
  for part in field.split("."):
    value = value[part]
  if value not in allowed:
    raise ConfigError(f"`{field}`={value!r} unknown; allowed: {', '.join(map(str, allowed))}")


def _number(config, field, minimum, integer=True, strict=False, also=""):
  """`field` must be a number (an integer) >= `minimum` (> with `strict`); `also` names another
  value the field allows, for the message (e.g. "-1 (the whole split)")."""
  value = config
  for part in field.split("."):
    value = value[part]
  kind = "an integer" if integer else "a number"
  if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
    raise ConfigError(f"`{field}`={value!r} must be {kind}")
  if value < minimum or (strict and value == minimum):
    relation = ">" if strict else ">="
    raise ConfigError(f"`{field}`={value!r} must be {also + ' or ' if also else ''}{kind} "
                      f"{relation} {minimum}")


def _non_finite(node, prefix=""):
  """The first field (dotted name, value) holding NaN or an infinity, anywhere in the config."""
  for key in node.keys():
    value = node[key]
    name = f"{prefix}{key}"
    if hasattr(value, "keys"):
      found = _non_finite(value, name + ".")
      if found:
        return found
    elif isinstance(value, float) and not math.isfinite(value):
      return name, value
  return None


def _unknown_fields(config):
  """Refuses a field that microstep does not read inside one of its own groups (`optimizer`,
  `per_example`, ...): a misspelt `per_example.every_step = 1` in a config file otherwise leaves
  the default in force without a word (on the command line ml_collections refuses it). Top-level
  names are the user's own (a task's `config.my_task`); one that nearly matches a microstep
  field, or names a field of one of its groups, is logged as a warning."""
  defaults = config_defaults.base_config()
  groups = {name for name in defaults.keys() if hasattr(defaults[name], "keys")}
  for group in sorted(groups & set(config.keys())):
    known = list(defaults[group].keys())
    for key in (config[group].keys() if hasattr(config[group], "keys") else ()):
      if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean `{group}.{close[0]}`?)" if close else ""
        raise ConfigError(f"`{group}.{key}` is not a field{hint}; allowed in {group}: "
                          f"{', '.join(sorted(known))}")
  nested = {key: f"{group}.{key}" for group in groups for key in defaults[group].keys()}
  for key in sorted(set(config.keys()) - set(defaults.keys())):
    close = difflib.get_close_matches(key, [k for k in defaults.keys() if k not in groups], n=1,
                                      cutoff=0.85)
    if key in nested or close:
      logging.warning("config: `%s` is not a field microstep reads (did you mean `%s`?); a "
                      "task's own fields belong in a group of their own, e.g. `config.my_task`",
                      key, nested.get(key) or close[0])


def _missing_fields(config):
  """Refuses a config that is not a ConfigDict holding every field of `base_config()`: a
  `get_config` that built its own (a plain dict, or a ConfigDict of a few fields) failed later
  with a KeyError traceback (a probe, 2026-12-08)."""
  start = ("start get_config from `config = config_defaults.base_config()` (trainer/"
           "config_defaults.py) and change the fields you need")
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"the config is a {type(config).__name__}, not an "
                      f"ml_collections.ConfigDict; {start}")
  defaults = config_defaults.base_config()
  missing = []
  for name in defaults.keys():
    if name not in config:
      missing.append(name)
    elif hasattr(defaults[name], "keys"):
      if not hasattr(config[name], "keys"):
        raise ConfigError(f"`{name}`={config[name]!r} must be a group of fields "
                          f"({', '.join(defaults[name].keys())}); {start}")
      missing += [f"{name}.{key}" for key in defaults[name].keys() if key not in config[name]]
  if missing:
    shown = ", ".join(f"`{name}`" for name in missing[:5]) + (
        f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    raise ConfigError(f"the config lacks {shown}; {start}")


def validate(config) -> None:
  """Raises ConfigError for the first bad field."""
  _missing_fields(config)
  _unknown_fields(config)
  bad = _non_finite(config)
  if bad:
    raise ConfigError(f"`{bad[0]}`={bad[1]!r} must be a finite number")
  _choice(config, "strategy", strategies.STRATEGIES)
  if not isinstance(config.task, str) or not config.task:
    raise ConfigError(f"`task`={config.task!r} must be a built-in task name or an import path "
                      "`package.module:ClassName`")
  _choice(config, "mixed_precision", PRECISIONS)
  _choice(config, "mode", MODES)
  _choice(config, "data.resume", ("auto", "iterator", "skip"))
  _choice(config, "optimizer.name", optimizers.OPTIMIZERS)
  _choice(config, "optimizer.decay", ("constant", "cosine"))
  _choice(config, "accumulation.batchnorm", ("error", "per_micro_batch"))
  _choice(config, "accumulation.mode", ("sum", "gradcache"))
  _choice(config, "xla", ("auto", "on", "off"))
  _choice(config, "replica_state", ("mean", "local"))
  _choice(config, "per_example.general_path", ("vectorized_map", "loop", "error"))
  for field in ("batch_size", "eval_batch_size", "train_steps", "steps_per_loop", "eval_every",
                "checkpoint_every", "accumulation.steps", "keep_checkpoints"):
    _number(config, field, 1)
  for field in ("cpu_replicas", "seed", "optimizer.warmup_steps", "summary_every",
                "max_consecutive_skips", "per_example.every_steps"):
    _number(config, field, 0)
  if config.seed > 2**32 - 1:  # Keras' set_random_seed raised a traceback (a probe).
    raise ConfigError(f"`seed`={config.seed} is too large; allowed: 0 to {2**32 - 1}")
  _number(config, "optimizer.learning_rate", 0, integer=False, strict=True)
  _number(config, "peer_timeout_s", 0, integer=False, strict=True)
  _number(config, "skip_window", 1)
  _number(config, "max_skipped_fraction", 0, integer=False, strict=True)
  if config.max_skipped_fraction > 1:
    raise ConfigError(f"`max_skipped_fraction`={config.max_skipped_fraction} must be in (0, 1]")
  if not isinstance(config.allow_config_change, str):
    raise ConfigError(f"`allow_config_change`={config.allow_config_change!r} must be a comma "
                      "separated list of field names")
  from trainer import workdir  # pylint: disable=g-import-not-at-top  (It imports this module.)
  workdir.allowed_changes(config)
  _number(config, "collective_timeout_s", 0, integer=False)
  _number(config, "eval_timeout_s", 0, integer=False, strict=True)
  for field in ("optimizer.momentum", "optimizer.weight_decay", "optimizer.global_clipnorm"):
    _number(config, field, 0, integer=False)
  if config.optimizer.momentum >= 1:
    raise ConfigError(f"`optimizer.momentum`={config.optimizer.momentum} must be in [0, 1)")
  if config.optimizer.name != "sgd":  # Keras' Adam and AdamW take neither: it was ignored.
    for field, unset in (("momentum", 0.0), ("nesterov", False)):
      if config.optimizer[field] != unset:
        raise ConfigError(
            f"`optimizer.{field}`={config.optimizer[field]!r} applies to `optimizer.name`=sgd "
            f"only; with {config.optimizer.name}, `optimizer.beta_1` plays its part (allowed: "
            f"{unset!r}, or `optimizer.name`=sgd)")
  if config.eval_steps != -1:
    _number(config, "eval_steps", 1, also="-1 (the whole split)")
  if config.cpu_replicas and config.strategy != "mirrored":
    raise ConfigError(f"`cpu_replicas`={config.cpu_replicas} needs `strategy`=mirrored, "
                      f"not {config.strategy!r}")
  if config.strategy == "tpu" and not config.tpu_address:
    raise ConfigError("`tpu_address` is empty; `strategy`=tpu needs `local` (TPU VM) or a TPU name")
  _number(config, "data.image_size", 1)
  for field in ("loss_scale.growth_interval", "triplet.embedding_dim",
                "data.synthetic_train_examples", "data.synthetic_test_examples"):
    _number(config, field, 1)
  for field in ("loss_scale.initial", "optimizer.epsilon"):
    _number(config, field, 0, integer=False, strict=True)
  _number(config, "triplet.margin", 0, integer=False)
  _number(config, "contrastive.temperature", 0, integer=False, strict=True)
  for field in ("optimizer.beta_1", "optimizer.beta_2"):
    _number(config, field, 0, integer=False)
    if config.optimizer[field.split(".")[1]] >= 1:
      raise ConfigError(f"`{field}`={config.optimizer[field.split('.')[1]]} must be in [0, 1)")
  if config.summary_every and config.summary_every % config.steps_per_loop:
    raise ConfigError(f"`summary_every`={config.summary_every} must be a multiple of "
                      f"`steps_per_loop`={config.steps_per_loop}")
  if config.per_example.every_steps and config.task == "triplet":
    raise ConfigError("`per_example.every_steps` needs one model row per example; `task`=triplet "
                      "stacks three (anchor, positive, negative); set it to 0")
  if config.cpu_replicas:
    validate_replicas(config, config.cpu_replicas)


def validate_replicas(config, num_replicas: int) -> None:
  """Batch sizes must split evenly over the replicas (eager, after the strategy exists)."""
  for field in ("batch_size", "eval_batch_size"):
    if config[field] % num_replicas:
      raise ConfigError(f"`{field}`={config[field]} is not divisible by the {num_replicas} "
                        "replicas; allowed: a multiple of the replica count")
