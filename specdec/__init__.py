"""specdec: fast, lossless and fair speculative decoding.

``specdec.generate`` runs speculative decoding on any pair of Hugging Face causal LMs; ``specdec.rejection_sample``
and ``specdec.divergence`` are the fused kernels behind it and behind the fairness metrics.
"""

from specdec import data, decoding, fairness, training
from specdec.compat import SpecdecWarning
from specdec.decoding.generation import GenerateOutput, SpecDecodeStats, clear_static_caches, generate
from specdec.decoding.ngram import NgramDrafter, ngram_drafter
from specdec.decoding.sampling import RejectionSampleOutput, filter_logits, rejection_sample
from specdec.decoding.self_drafter import layer_skip_drafter
from specdec.fairness import (
    CostRatio,
    FairnessReport,
    TaskData,
    TaskFairness,
    WallClockSpeedup,
    evaluate,
    measure_decode_costs,
    measure_wall_clock_speedup,
    unfairness,
)
from specdec.fairness.divergences import (
    DivergenceOutput,
    PerTaskDivergence,
    divergence,
    divergence_loss,
    fused_linear_divergence_loss,
)
from specdec.fairness.metrics import accepted_count_distribution, expected_tokens_per_call, speedup
from specdec.training import finetune, losses  # the modules, also reachable as specdec.training.finetune, .losses
from specdec.training.finetune import CheckpointError, FinetuneConfig, FinetuneResult, finetune_drafter
from specdec.training.losses import scdf_loss, scdf_weights

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CostRatio",
    "FairnessReport",
    "FinetuneConfig",
    "FinetuneResult",
    "SpecdecWarning",
    "TaskData",
    "TaskFairness",
    "WallClockSpeedup",
    "evaluate",
    "data",
    "decoding",
    "fairness",
    "finetune",
    "finetune_drafter",
    "losses",
    "training",
    "scdf_loss",
    "scdf_weights",
    "unfairness",
    "DivergenceOutput",
    "PerTaskDivergence",
    "divergence",
    "divergence_loss",
    "fused_linear_divergence_loss",
    "GenerateOutput",
    "RejectionSampleOutput",
    "SpecDecodeStats",
    "__version__",
    "accepted_count_distribution",
    "clear_static_caches",
    "expected_tokens_per_call",
    "filter_logits",
    "generate",
    "layer_skip_drafter",
    "NgramDrafter",
    "ngram_drafter",
    "measure_decode_costs",
    "measure_wall_clock_speedup",
    "rejection_sample",
    "speedup",
]
