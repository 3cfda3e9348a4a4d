"""Benchmark dispatcher: `python -m trainer.bench <name> [args]` runs `trainer.bench.<name>.main`.

Runs eagerly on the host. A module that defines absl flags (a module-level `FLAGS`, e.g.
`trainer.bench.loop`) is started with `absl.app.run`, which parses [args] into FLAGS and calls
`main` with the leftover argv; any other module (e.g. `trainer.bench.per_example`, argparse) gets
`main(args)` with the raw argument list.
"""
import functools
import importlib
import re
import sys

from absl import app
from absl import flags

from trainer import bench
from trainer import flag_errors
from trainer.bench import util as bench_util


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  names = bench.available()
  if not argv or argv[0] in ("-h", "--help"):
    print(f"usage: python -m trainer.bench <name> [args]; name one of: {', '.join(names)}")
    return 0 if argv else 2
  name = argv[0]
  if not re.fullmatch(r"[a-z0-9_]+", name) or name not in names:
    print(f"trainer.bench: unknown benchmark {name!r}; allowed: {', '.join(names)}",
          file=sys.stderr)
    return 2
  module = importlib.import_module(f"trainer.bench.{name}")
  if isinstance(getattr(module, "FLAGS", None), flags.FlagValues):
    if set(argv[1:]) & {"-h", "--help", "-?", "--helpshort"}:
      # absl's own help describes the main module, this dispatcher, and none of the flags.
      print(f"{(module.__doc__ or '').strip()}\n\n{flags.FLAGS.module_help(module)}")
      return 0
    app.run(module.main, argv=[f"trainer.bench {name}"] + argv[1:],  # Exits when main returns.
            flags_parser=functools.partial(_parse_flags, name))
  return int(module.main(argv[1:]) or 0)


def _parse_flags(name, argv):
  """absl's parsing; a bad flag, or a `--json` file that cannot be written, is one line and
  exit 2 before anything is measured."""
  try:
    with flag_errors.help_exits_zero(argv):  # absl's `--help` exits 1.
      rest = flags.FLAGS(argv)
  except flags.Error as e:
    _fail(name, " ".join(str(e).split()))
  problem = bench_util.unwritable(flags.FLAGS["json"].value) if "json" in flags.FLAGS else ""
  if problem:
    _fail(name, f"--json: {problem}")
  return rest


def _fail(name, message):
  print(f"trainer.bench {name}: error: {message}", file=sys.stderr)
  sys.exit(2)


if __name__ == "__main__":
  sys.exit(main())
