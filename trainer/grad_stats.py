"""Compatibility alias for `trainer.per_example.statistics` (the statistics moved there).

Kept only so that `trainer/per_example_summaries.py` keeps importing until the trainer
integration of issue 10 moves it to `trainer.per_example`; delete it then.
"""
from trainer.per_example.statistics import *  # pylint: disable=wildcard-import,unused-wildcard-import
from trainer.per_example.statistics import replica_statistics  # pylint: disable=unused-import
