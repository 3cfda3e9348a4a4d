"""The full set of config fields, their defaults, and the shared variant args.

Every recipe in `configs/` starts from `base_config()` and overrides a handful of fields, so the
field names below are the public contract (documented in docs/config.md). Runs eagerly, on the host.
"""
import ml_collections

DATA_DIR = "/usr/share/datasets/fashion-mnist"


def base_config() -> ml_collections.ConfigDict:
  """Returns a config with every field microstep reads, set to its default."""
  config = ml_collections.ConfigDict()
  # --- Where it runs.
  config.strategy = "default"   # default | one_device | mirrored | multi_worker_mirrored | tpu
  config.cpu_replicas = 0       # >0: split the CPU into this many logical devices (mirrored).
  config.tpu_address = ""       # `local` on a TPU VM, else the TPU name or grpc:// address.
  config.device = ""            # one_device only; empty picks GPU:0 when present, else CPU:0.
  config.peer_timeout_s = 120   # multi-worker: give up on a missing peer after this long.
  config.collective_timeout_s = 0  # multi-worker: abort one all-reduce after this long; 0: never.
  config.xla = "auto"           # auto (on for GPUs, off on CPUs; TPUs always compile) | on | off
  # --- What it trains.
  # A built-in task (trainer/tasks/__init__.py BUILT_IN: classification, triplet, ...) or an
  # import path `package.module:ClassName` of your own (trainer.base_task, docs/tasks.md).
  config.task = "classification"
  config.model = "small_cnn"      # Built-in tasks: small_cnn | small_cnn_bn | mlp | vgg16 | vgg_small
  config.mixed_precision = "float32"  # float32 | mixed_float16 | mixed_bfloat16
  config.seed = 0
  config.deterministic = False  # tf.config.experimental.enable_op_determinism()
  # mean: variables the forward pass writes per replica (BatchNorm statistics) are averaged
  # across replicas once per update, in the update's all-reduce | local: left per replica.
  config.replica_state = "mean"
  config.data = ml_collections.ConfigDict()
  config.data.shuffle = True    # Random-access sources: a new permutation every epoch.
  # tf.data sources: how a restart finds its place. auto: restore the input iterator saved with
  # the checkpoint (skip on TPUs, where iterators cannot be saved) | iterator | skip.
  config.data.resume = "auto"
  # Fashion-MNIST tasks (classification, triplet):
  config.data.name = "fashion_mnist"
  config.data.source = "idx"    # idx (Debian package files) | tfds | synthetic
  config.data.dir = DATA_DIR
  config.data.synthetic_train_examples = 2048
  config.data.synthetic_test_examples = 512
  config.data.image_size = 28   # Images are resized (bilinear) when this differs from 28.
  # npz_classification: arrays <features_key>_train, <labels_key>_train (+ _test) in one file.
  config.data.path = ""
  config.data.features_key = "x"
  config.data.labels_key = "y"
  config.data.num_classes = 0   # 0: max(label) + 1.
  # --- How long and how big. One step = one optimizer update.
  config.batch_size = 128       # Global examples per micro-step, all replicas together.
  config.eval_batch_size = 1000
  config.train_steps = 1000     # Optimizer updates.
  config.steps_per_loop = 100
  config.mode = "train_and_eval"  # train | eval | train_and_eval | continuous_eval | export
  config.export_at_end = True   # After training: a SavedModel in workdir/export/<update>.
  config.eval_every = 1000      # Updates between evaluations.
  config.eval_steps = -1        # -1: the whole test split.
  config.eval_timeout_s = 600   # continuous_eval: stop after this long without a new checkpoint.
  config.checkpoint_every = 1000  # Updates between checkpoints.
  config.keep_checkpoints = 3
  config.summary_every = 0      # Updates between in-loop summaries; 0: every loop end.
  config.max_consecutive_skips = 20  # Non-finite updates in a row before the run stops.
  config.max_skipped_fraction = 0.5  # ... or more than this fraction of the last skip_window.
  config.skip_window = 100
  # Restart guard: fields (comma separated) allowed to differ from workdir/config.json although
  # they change what the saved state means (trainer/workdir.py RESUME_FIXED).
  config.allow_config_change = ""
  # --- Optimizer and schedule.
  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.name = "adam"  # sgd | adam | adamw
  config.optimizer.learning_rate = 1e-3
  config.optimizer.momentum = 0.0
  config.optimizer.nesterov = False
  config.optimizer.beta_1 = 0.9
  config.optimizer.beta_2 = 0.999
  config.optimizer.epsilon = 1e-7
  config.optimizer.weight_decay = 0.0
  config.optimizer.global_clipnorm = 0.0  # 0: off. Clips the reduced gradient, once per update.
  config.optimizer.warmup_steps = 0       # Linear warm-up, in updates.
  config.optimizer.decay = "constant"     # constant | cosine (to 0 at train_steps)
  # --- Gradient accumulation.
  config.accumulation = ml_collections.ConfigDict()
  config.accumulation.steps = 1           # Micro-steps per update (k).
  # sum: add micro-batch gradients (exact for per-example losses) | gradcache: two passes, exact
  # for batch-level losses (base_task.BatchLossTask, docs/accumulation.md).
  config.accumulation.mode = "sum"
  config.accumulation.batchnorm = "error"  # error | per_micro_batch
  # --- Dynamic loss scaling (mixed_float16 only).
  config.loss_scale = ml_collections.ConfigDict()
  config.loss_scale.initial = 2.0 ** 15
  config.loss_scale.growth_interval = 2000
  # --- Per-example gradient statistics.
  config.per_example = ml_collections.ConfigDict()
  config.per_example.every_steps = 0      # 0: off.
  # Variables without a direct per-example formula: vectorized_map | loop | error.
  config.per_example.general_path = "vectorized_map"
  # --- Triplet task only.
  config.triplet = ml_collections.ConfigDict()
  config.triplet.margin = 0.2
  config.triplet.embedding_dim = 64
  # --- contrastive_pairs task only (InfoNCE with in-batch negatives).
  config.contrastive = ml_collections.ConfigDict()
  config.contrastive.temperature = 0.1
  # --- histogram_chi_square task only (a chi-square between soft histograms).
  config.histogram = ml_collections.ConfigDict()
  config.histogram.bins = 16
  config.histogram.width = 0.15     # Gaussian kernel width, in output units (range [-2, 2]).
  config.histogram.features = 8
  config.histogram.train_examples = 4096
  # --- text_classification task only: generated token sequences, a small Transformer.
  config.text = ml_collections.ConfigDict()
  config.text.vocab_size = 1000
  config.text.sequence_length = 16
  config.text.target_token = 7      # The label: does this token occur in the sequence?
  config.text.embedding_dim = 32
  config.text.num_heads = 2
  config.text.key_dim = 16
  config.text.train_examples = 4096
  config.text.test_examples = 1024
  return config


def parse_args(arg: str) -> set:
  """`a,b,c` -> {a, b, c}: the variant args after the config file name (`file.py:a,b,c`)."""
  return {a.strip() for a in (arg or "").split(",") if a.strip()}


def split_args(arg: str, allowed) -> set:
  """Parses `a,b,c` into {a, b, c}, refusing names outside `allowed`."""
  args = parse_args(arg)
  unknown = args - set(allowed)
  if unknown:
    raise ValueError(f"config arg {sorted(unknown)} unknown; allowed: {sorted(allowed)}")
  return args


def apply_variant_args(config: ml_collections.ConfigDict, arg: str,
                       recipe_args=()) -> ml_collections.ConfigDict:
  """Applies comma-separated variant args shared by all recipes.

  `smoke`: seconds-long run (tests, CI). `synthetic`: generated data instead of the real files.
  `recipe_args` are extra names a recipe handles itself (accepted here, not applied).
  """
  args = split_args(arg, {"smoke", "synthetic"} | set(recipe_args))
  if "smoke" in args:
    config.batch_size = min(config.batch_size, 32)
    config.train_steps = 12
    config.steps_per_loop = 4
    config.eval_every = 12
    config.checkpoint_every = 4
    config.eval_batch_size = 256
    config.eval_steps = 2
  if "synthetic" in args:
    config.data.source = "synthetic"
  return config
