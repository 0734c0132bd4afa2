"""Installs ``specdec``; the Triton kernels in ``kernels/`` are installed as ``specdec.kernels``, and the built-in
evaluation data in ``specdec/datasets/`` (with its license and source note) as package data."""

from setuptools import find_packages, setup

setup(
    name="specdec",
    version="0.1.0",
    description="Triton kernels for lossless speculative decoding, and tools to measure and repair its disparate "
    "speed-ups across tasks and languages.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[*find_packages(include=["specdec", "specdec.*"]), "specdec.kernels"],
    package_dir={"specdec": "specdec", "specdec.kernels": "kernels"},
    package_data={"specdec": ["datasets/*/*.tsv", "datasets/*/LICENSE.txt", "datasets/*/README.md",
                              "datasets/*/SHA256SUMS"]},
    include_package_data=False,
    install_requires=[
        "torch>=2.4",
        "triton>=3.0",
        "transformers>=4.56,<6",
        "numpy>=1.24",
        "tqdm>=4.60",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "huggingface-hub>=0.23",
        "matplotlib>=3.7",
    ],
    extras_require={
        # setuptools, wheel: the install test; gguf, accelerate: transformers' GGUF loading (the multilingual
        # pipeline's GGUF verifier test)
        "test": ["pytest>=7", "ruff>=0.5", "setuptools>=64", "wheel", "gguf>=0.10", "accelerate>=1.0"],
        "bench": ["pytest-benchmark>=4"],
    },
    entry_points={"console_scripts": ["specdec=specdec.cli:main"]},
)
