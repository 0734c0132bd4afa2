"""Decoding: :func:`generate` (speculative decoding on the static or the eager path), the rejection sampler's public
wrapper, the layer-skip self-drafter, the model-free n-gram drafter and the automatic draft length."""

from specdec.decoding.generation import GenerateOutput, SpecDecodeStats, clear_static_caches, generate
from specdec.decoding.ngram import NgramDrafter, ngram_drafter
from specdec.decoding.sampling import RejectionSampleOutput, filter_logits, rejection_sample
from specdec.decoding.self_drafter import layer_skip_drafter

__all__ = [
    "GenerateOutput",
    "RejectionSampleOutput",
    "SpecDecodeStats",
    "clear_static_caches",
    "filter_logits",
    "generate",
    "layer_skip_drafter",
    "NgramDrafter",
    "ngram_drafter",
    "rejection_sample",
]
