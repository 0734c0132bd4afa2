"""Repairing the disparity: s-CDF and its baselines (:func:`finetune_drafter`), their losses and weights, and the
checkpoints that resume a run exactly. Only the drafter is updated; the verifier stays bitwise unchanged."""

from specdec.training.checkpoint import weights_digest
from specdec.training.finetune import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    METHODS,
    PER_CHARACTER_METHODS,
    WEIGHT_BASES,
    CheckpointError,
    FinetuneConfig,
    FinetuneInterrupted,
    FinetuneResult,
    check_seq_len,
    finetune_drafter,
    held_out_split,
    load_checkpoint,
    save_checkpoint,
)
from specdec.training.losses import scdf_loss, scdf_weights

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_NAME",
    "METHODS",
    "PER_CHARACTER_METHODS",
    "WEIGHT_BASES",
    "CheckpointError",
    "FinetuneConfig",
    "FinetuneInterrupted",
    "FinetuneResult",
    "check_seq_len",
    "finetune_drafter",
    "held_out_split",
    "load_checkpoint",
    "save_checkpoint",
    "scdf_loss",
    "scdf_weights",
    "weights_digest",
]
