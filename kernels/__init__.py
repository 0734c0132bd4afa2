"""Triton kernels and their torch references, one fused op per module (installed as ``specdec.kernels``)."""
