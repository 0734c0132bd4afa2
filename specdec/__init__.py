"""specdec: fast, lossless and fair speculative decoding."""
