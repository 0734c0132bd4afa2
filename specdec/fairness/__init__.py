"""Measuring the disparity: per-task acceptance, divergences, predicted and measured speed-ups, unfairness U
(:func:`evaluate`), the fused divergence metric and the report."""

from specdec.fairness.divergences import (
    DivergenceOutput,
    PerTaskDivergence,
    divergence,
    divergence_loss,
    fused_linear_divergence_loss,
)
from specdec.fairness.evaluation import (
    CostRatio,
    FairnessReport,
    TaskData,
    TaskFairness,
    WallClockSpeedup,
    divergences_from_logits,
    encode_items,
    evaluate,
    measure_decode_costs,
    measure_wall_clock_speedup,
    pad_batch,
    spearman,
    task_divergences,
    unfairness,
)
from specdec.fairness.metrics import accepted_count_distribution, expected_tokens_per_call, speedup

__all__ = [
    "CostRatio",
    "DivergenceOutput",
    "FairnessReport",
    "PerTaskDivergence",
    "TaskData",
    "TaskFairness",
    "WallClockSpeedup",
    "accepted_count_distribution",
    "divergence",
    "divergence_loss",
    "divergences_from_logits",
    "encode_items",
    "evaluate",
    "expected_tokens_per_call",
    "fused_linear_divergence_loss",
    "measure_decode_costs",
    "measure_wall_clock_speedup",
    "pad_batch",
    "spearman",
    "speedup",
    "task_divergences",
    "unfairness",
]
