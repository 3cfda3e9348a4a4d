"""Runs the trainer on one machine: CPU only, one GPU, or several GPUs in sync.

  python -m launch.single_machine --config=configs/fashion_mnist.py --workdir=/tmp/fmnist --gpus=2

What `--gpus=N` turns into:

  N = 0   CUDA_VISIBLE_DEVICES='' (the GPUs are hidden); the config's own strategy is kept, so
          `--override strategy=mirrored --override cpu_replicas=2` still splits the CPU.
  N = 1   --config.strategy=one_device on the first visible GPU.
  N > 1   --config.strategy=mirrored over the first N visible GPUs (one replica per GPU).

The GPUs are picked with CUDA_VISIBLE_DEVICES: 0..N-1, or the first N entries of a
CUDA_VISIBLE_DEVICES that is already set. While the trainer exits with PREEMPTED_EXIT_CODE (it was
stopped and wrote a checkpoint) or PEER_LOST_EXIT_CODE, the same command is started again, at most
`--max_restarts` times, and resumes from the checkpoint in `--workdir`. A SIGTERM to the launcher is passed on to the
trainer (so it can checkpoint) and ends the launcher without a restart.
"""
import os
import sys
from typing import Mapping, Sequence

from absl import flags

from launch import common

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the flags; called only when run as a program, so that the launchers (and the
  trainer, which has its own --config) can be imported into one process, e.g. by tests."""
  flags.DEFINE_string("config", None, "Recipe file and args, e.g. configs/fashion_mnist.py:smoke.")
  flags.DEFINE_string("workdir", None, "Checkpoints and summaries; reused on restart.")
  flags.DEFINE_integer("gpus", 0, "0: CPU only; 1: one_device; N>1: mirrored over N GPUs.")
  flags.DEFINE_multi_string(
      "override", [], "Config override FIELD=VALUE (repeatable), passed as --config.FIELD=VALUE.")
  flags.DEFINE_integer(
      "max_restarts", 3, "Restarts after a preemption exit (42) before giving up.")
  flags.DEFINE_string("python", sys.executable, "Python interpreter for the trainer.")
  flags.DEFINE_bool("dry_run", False, "Print the command, one shell line, and run nothing.")


def build_command(config: str, workdir: str, gpus: int, overrides: Sequence[str] = (),
                  python: str = sys.executable,
                  environ: Mapping[str, str] | None = None) -> common.Command:
  """The trainer command for `gpus` GPUs (see the module docstring)."""
  environ = os.environ if environ is None else environ
  common.check_required(config=config, workdir=workdir)
  if gpus < 0:
    raise common.LaunchError(f"--gpus={gpus} is invalid; allowed: 0 (CPU only) or a GPU count >= 1")
  common.check_config_file(config)
  parsed = common.parse_overrides(overrides)
  if gpus == 0:
    settings = list(parsed)
    devices = ""
  else:
    strategy = "one_device" if gpus == 1 else "mirrored"
    settings = common.merge_settings({"strategy": strategy}, parsed, f"for --gpus={gpus}")
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and len(visible) < gpus:
      raise common.LaunchError(
          f"--gpus={gpus} but CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']} lists only "
          f"{len(visible)}; allowed: --gpus <= {len(visible)}")
    devices = ",".join(visible[:gpus] if visible else [str(i) for i in range(gpus)])
  argv = common.trainer_argv(python, config, workdir, settings)
  return common.command(*argv, env={"CUDA_VISIBLE_DEVICES": devices})


def launch(cmd: common.Command, max_restarts: int) -> int:
  """Runs `cmd`, again after each preemption exit, at most `max_restarts` extra times."""
  return common.run_with_restarts(
      lambda attempt: common.run(cmd), max_restarts, "trainer",
      restart_codes=common.RESTART_CODES)


def main(argv: Sequence[str]) -> int:
  del argv
  common.check_non_negative("max_restarts", FLAGS.max_restarts)
  cmd = build_command(FLAGS.config, FLAGS.workdir, FLAGS.gpus, FLAGS.override, FLAGS.python)
  if FLAGS.dry_run:
    common.print_commands([cmd])
    return 0
  common.log(f"running: {cmd.shell()}")
  return launch(cmd, FLAGS.max_restarts)


if __name__ == "__main__":
  define_flags()
  common.run_main(main)
