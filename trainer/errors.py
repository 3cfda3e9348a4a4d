"""Errors that the command line turns into one line on stderr and exit code 2.

Kept free of other trainer imports so that any module can raise them without import cycles.
"""


class ConfigError(ValueError):
  """A config field (or the workdir, or the cluster environment) cannot be run with."""
