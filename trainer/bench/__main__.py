"""Benchmark dispatcher: `python -m trainer.bench <name> [args]` runs `trainer.bench.<name>.main`.

Runs eagerly on the host. A module that defines absl flags (a module-level `FLAGS`, e.g.
`trainer.bench.loop`) is started with `absl.app.run`, which parses [args] into FLAGS and calls
`main` with the leftover argv; any other module (e.g. `trainer.bench.per_example`, argparse) gets
`main(args)` with the raw argument list.
"""
import importlib
import re
import sys

from absl import app
from absl import flags

from trainer import bench


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
    app.run(module.main, argv=[f"trainer.bench {name}"] + argv[1:])  # Exits when main returns.
  return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
  sys.exit(main())
