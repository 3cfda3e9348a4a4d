"""The one place that turns `config.strategy` into a `tf.distribute.Strategy`.

Nothing else in microstep reads TF_CONFIG or the TPU environment. Runs eagerly, on the host, before
any model or dataset is built (logical CPU devices can only be created before TF initialises).

| config.strategy          | what it builds                                                      |
|--------------------------|---------------------------------------------------------------------|
| default                  | `tf.distribute.get_strategy()`: no distribution, one device         |
| one_device               | `OneDeviceStrategy(config.device or GPU:0 or CPU:0)`                |
| mirrored                 | all local GPUs, or `cpu_replicas` logical CPU devices if > 0        |
| multi_worker_mirrored    | `MultiWorkerMirroredStrategy` from TF_CONFIG                        |
| tpu                      | `TPUStrategy` on `tpu_address`: `local`, or a pod slice's name      |
"""
import contextlib
import itertools
import json
import os
import subprocess
import sys

from absl import logging
import tensorflow as tf

from trainer import errors

STRATEGIES = ("default", "one_device", "mirrored", "multi_worker_mirrored", "tpu")


_mirrored_created = itertools.count()


def mirrored_strategy(devices=None) -> tf.distribute.MirroredStrategy:
  """A MirroredStrategy whose collective keys cannot collide with an earlier one's.

  Every MirroredStrategy numbers its collective groups and instances from the same start, and the
  collective runtime caches each instance's shape per process; a second strategy in one process
  (tests, notebooks, benchmark drivers) then reuses instance keys with other shapes and aborts
  ("Shape mismatch in the collective instance"). TF reads the start from the class attribute
  `_collective_key_base` during construction, so each strategy gets its own range.
  """
  cls = tf.distribute.MirroredStrategy
  saved = cls._collective_key_base  # pylint: disable=protected-access
  cls._collective_key_base = saved + 10_000 * (1 + next(_mirrored_created))  # pylint: disable=protected-access
  try:
    return cls(devices)
  finally:
    cls._collective_key_base = saved  # pylint: disable=protected-access


def _logical_cpus(count: int) -> list[str]:
  """Returns `count` logical CPU device names, splitting the CPU if TF is not initialised yet."""
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count)
  except RuntimeError:
    pass  # Already initialised: use what exists, if there are enough.
  available = tf.config.list_logical_devices("CPU")
  if len(available) < count:
    raise errors.ConfigError(
        f"`cpu_replicas`={count} but TensorFlow was initialised with {len(available)} logical "
        "CPU device(s); create the strategy before running any TF op.")
  return [d.name for d in available[:count]]


_WATCHDOG = """
import os, select, signal, sys
ready, _, _ = select.select([int(sys.argv[1])], [], [], float(sys.argv[2]))
if not ready:
  sys.stderr.write(sys.argv[3] + "\\n")
  sys.stderr.flush()
  os.kill(int(sys.argv[4]), signal.SIGKILL)
"""


@contextlib.contextmanager
def _killed_if_stuck(seconds: float, message: str):
  """SIGKILLs this process, after printing `message`, if the block runs longer than `seconds`.

  MultiWorkerMirroredStrategy's constructor waits in C++, holding the GIL, until every worker has
  connected: forever, and deaf to SIGTERM (TF's own preemption notifier takes it). No Python thread
  or signal handler can run meanwhile, so a small watchdog process, which exits quietly as soon as
  the block ends (or this process dies and closes the pipe), does the stopping.
  """
  read_end, write_end = os.pipe()
  watchdog = subprocess.Popen(
      [sys.executable, "-c", _WATCHDOG, str(read_end), str(seconds),
       f"microstep: error: {message}", str(os.getpid())], pass_fds=(read_end,))
  os.close(read_end)
  try:
    yield
  finally:
    os.write(write_end, b"done")
    os.close(write_end)
    watchdog.wait(timeout=30)


def _multi_worker(config) -> tf.distribute.Strategy:
  tf_config = os.environ.get("TF_CONFIG", "")
  if not tf_config:
    raise errors.ConfigError("`strategy`=multi_worker_mirrored needs the TF_CONFIG environment variable "
                     "(see docs/launch.md or `python -m launch.multi_worker --local=2`).")
  try:
    parsed = json.loads(tf_config)
    cluster, task = parsed["cluster"], parsed.get("task", {})
  except (ValueError, KeyError, TypeError) as e:
    raise errors.ConfigError(f"TF_CONFIG is not valid JSON with a `cluster` key: {e}") from None
  task_type, index = task.get("type", "worker"), task.get("index", 0)
  members = cluster.get(task_type) if isinstance(cluster, dict) else None
  if not isinstance(members, list) or not isinstance(index, int) or not 0 <= index < len(members):
    allowed = {k: len(v) for k, v in cluster.items()} if isinstance(cluster, dict) else cluster
    raise errors.ConfigError(
        f"TF_CONFIG task {task_type!r} index {index!r} is not in the cluster {allowed}; allowed: "
        f"a type of the cluster and an index below its count")
  logging.info("multi-worker cluster: %s", cluster)
  # `peer_timeout_s` bounds only the wait for every worker to arrive. A peer lost later is found
  # by TF's own health check, which aborts the collectives with UnavailableError (exit 43);
  # `collective_timeout_s` (0: none, TF's default) is the debugging aid TF documents at
  # https://www.tensorflow.org/api_docs/python/tf/distribute/experimental/CommunicationOptions,
  # so a slow first compile or restore is not mistaken for a lost peer.
  options = tf.distribute.experimental.CommunicationOptions(
      timeout_seconds=float(config.collective_timeout_s) or None)
  message = (f"not every worker of {cluster} arrived within `peer_timeout_s`="
             f"{config.peer_timeout_s}; start all workers together")
  with _killed_if_stuck(float(config.peer_timeout_s), message):
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def _tpu(config) -> tf.distribute.Strategy:
  """`local`: the chips of this TPU VM. Any other address (a TPU's name, e.g. a pod slice's, or
  grpc://HOST:PORT) is resolved and connected to as a cluster: on a pod slice this process is the
  one client, on worker 0, and every worker's TPU runtime service runs the computation. That
  client must leave worker 0's chips to the service: TPU_LOAD_LIBRARY=0 (launch/tpu_vm.py sets it).
  """
  if not config.tpu_address:
    raise errors.ConfigError("`strategy`=tpu needs `tpu_address` (`local` on a TPU VM, or a TPU "
                             "name)")
  try:
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=config.tpu_address)
    if config.tpu_address != "local":
      if os.environ.get("TPU_LOAD_LIBRARY") != "0":
        logging.warning("`tpu_address`=%s without TPU_LOAD_LIBRARY=0: on a TPU VM this process "
                        "takes the local chips that the slice's TPU runtime needs.",
                        config.tpu_address)
      tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
  except (ValueError, RuntimeError, tf.errors.OpError) as e:
    first = " ".join(str(e).split())[:160]
    raise errors.ConfigError(
        f"`strategy`=tpu: no TPU at `tpu_address`={config.tpu_address!r} ({type(e).__name__}: "
        f"{first}); on a TPU VM use `local`, else the TPU's name") from None
  return tf.distribute.TPUStrategy(resolver)


def device_kind(strategy) -> str:
  """'tpu', 'gpu' or 'cpu': what the strategy's replicas compute on (eager, host).

  The default strategy places ops on GPU:0 when one exists, like plain TensorFlow.
  """
  if isinstance(strategy, tf.distribute.TPUStrategy):
    return "tpu"
  if not tf.distribute.has_strategy() and strategy is tf.distribute.get_strategy():
    return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"  # The default strategy.
  devices = list(strategy.extended.worker_devices)
  return "gpu" if devices and all("GPU" in d.upper() for d in devices) else "cpu"


def task_key(config) -> str:
  """"" for one process and for the chief of a multi-worker job (they write the run's files and
  hold the workdir's main lock); "<type>_<index>" for the other workers (from TF_CONFIG)."""
  if config.strategy != "multi_worker_mirrored":
    return ""
  try:
    parsed = json.loads(os.environ.get("TF_CONFIG", "{}"))
    task, cluster = parsed.get("task", {}), parsed.get("cluster", {})
  except (ValueError, AttributeError):
    return ""  # _multi_worker reports a bad TF_CONFIG with one line.
  task_type, index = task.get("type", "worker"), task.get("index", 0)
  if task_type == "chief" or (task_type == "worker" and index == 0 and "chief" not in cluster):
    return ""
  return f"{task_type}_{index}"


def worker_role(strategy) -> tuple[bool, int]:
  """(whether this process is the chief, its worker index 0..W-1 in cluster order); eager.

  The index counts every worker task, the chief first (TF's `id_in_cluster`): it is this
  worker's input pipeline id and names its input-iterator checkpoints.
  """
  resolver = getattr(strategy, "cluster_resolver", None)
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
    return True, 0
  from tensorflow.python.distribute import multi_worker_util  # pylint: disable=g-import-not-at-top
  spec = resolver.cluster_spec()
  task_type, task_id = resolver.task_type, resolver.task_id or 0
  chief = multi_worker_util.is_chief(spec, task_type, task_id)
  return chief, multi_worker_util.id_in_cluster(spec, task_type, task_id)


def num_workers(strategy) -> int:
  """Worker processes of a MultiWorkerMirroredStrategy cluster (chief included); else 1."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
    return 1
  spec = resolver.cluster_spec().as_dict()
  return max(len(spec.get("worker", [])) + len(spec.get("chief", [])), 1)


def _one_device(config) -> tf.distribute.Strategy:
  """OneDeviceStrategy on `config.device`, which must exist here (no silent CPU fallback)."""
  device = config.device or ("/gpu:0" if tf.config.list_physical_devices("GPU") else "/cpu:0")
  available = [d.name for d in tf.config.list_logical_devices()]
  try:
    spec = tf.DeviceSpec.from_string(device)
  except ValueError:
    spec = None
  matches = spec is not None and spec.device_type is not None and any(
      (tf.DeviceSpec.from_string(a).device_type.upper(), tf.DeviceSpec.from_string(a).device_index)
      == (spec.device_type.upper(), spec.device_index or 0) for a in available)
  if not matches:
    short = ", ".join(f"/{tf.DeviceSpec.from_string(a).device_type.lower()}:"
                      f"{tf.DeviceSpec.from_string(a).device_index}" for a in available)
    raise errors.ConfigError(f"`device`={device!r} is not a device of this machine; allowed: "
                             f"{short}")
  return tf.distribute.OneDeviceStrategy(device)


def create_strategy(config) -> tf.distribute.Strategy:
  """Builds the strategy named by `config.strategy` (eager, host)."""
  name = config.strategy
  if name not in STRATEGIES:
    raise errors.ConfigError(f"`strategy`={name!r} unknown; allowed: {', '.join(STRATEGIES)}")
  if config.cpu_replicas and name != "mirrored":
    raise errors.ConfigError(f"`cpu_replicas`={config.cpu_replicas} only works with "
                             f"`strategy`=mirrored, not {name!r}")
  if name == "default":
    return tf.distribute.get_strategy()
  if name == "one_device":
    return _one_device(config)
  if name == "mirrored":
    if config.cpu_replicas:
      return mirrored_strategy(_logical_cpus(config.cpu_replicas))
    if not tf.config.list_physical_devices("GPU"):
      logging.warning("strategy=mirrored without GPUs and cpu_replicas=0: one CPU replica.")
    return mirrored_strategy()
  if name == "multi_worker_mirrored":
    return _multi_worker(config)
  return _tpu(config)
