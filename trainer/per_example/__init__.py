"""Per-example gradients and gradient statistics, for any training loop.

Modules, one concept each (every module's docstring states its execution context):
* `layers.py`, `conv.py`: the direct per-example formulas of standard Keras layers (Dense,
  EinsumDense/MultiHeadAttention, Embedding, LayerNormalization, GroupNormalization, Conv1D/2D/3D,
  their transposes, DepthwiseConv, SeparableConv), built on `terms.py`.
* `recording.py`: `Recorder`, which records the caller's own forward pass for those formulas;
  `examples_axis.py` (where the examples are: `labelling.py`, `axis_rules.py`) and `reads.py`
  tell it which layers must take the general path instead.
* `general.py`: the general path for any other variable (`vectorized_map` | `loop` | `error`).
* `gradients.py`: `per_example_gradients`, materialised [B, *shape] per variable.
* `ghost.py`: `ghost_norms`, per-example squared norms now and dots with a later gradient,
  without materialising [B, P].
* `statistics.py`: the statistics math, `replica_statistics` (from materialised gradients) and
  `ghost_statistics` (ghost path), each with one packed all-reduce and one all_gather.
See docs/per_example.md.
"""
from trainer.per_example.general import PATHS as GENERAL_PATHS
from trainer.per_example.general import Refused
from trainer.per_example.ghost import GhostTerms
from trainer.per_example.ghost import ghost_norms
from trainer.per_example.gradients import per_example_gradients
from trainer.per_example.recording import Recorder
from trainer.per_example.recording import Recording
from trainer.per_example.statistics import cosines
from trainer.per_example.statistics import diversity
from trainer.per_example.statistics import ghost_statistics
from trainer.per_example.statistics import local_sums
from trainer.per_example.statistics import noise_scale
from trainer.per_example.statistics import replica_statistics
from trainer.per_example.statistics import statistics_from_sums
from trainer.per_example.statistics import trace_estimate
