#!/usr/bin/env bash
# Build .fi/ (git-ignored): FlashInfer 0.2.14.post1 from its PyPI source distribution, importable without installing
# (PYTHONPATH=.fi), for the FlashInfer providers of benchmarks/bench_rejection.py on a GPU machine without network.
# The package JIT-compiles its kernels on first use from flashinfer/data/{csrc,include,cutlass,spdlog,tvm_binding},
# which a wheel ships and the source tree does not: here they are relative links into the unpacked sdist.
#   bash benchmarks/tools/setup_flashinfer_tree.sh      # with PyPI reachable (about 36 MB unpacked); copy .fi/ over
#   PYTHONPATH=$PWD/.fi FLASHINFER_CUDA_ARCH_LIST=9.0a python3 benchmarks/bench_rejection.py ...   # on the GPU
# (benchmarks/tools/run_gpu_validation.sh sets both when .fi/ exists.)
set -euo pipefail
cd "$(dirname "$0")/../.."
version=0.2.14.post1
url=$(curl -fsSL https://pypi.org/simple/flashinfer-python/ \
  | grep -o "https://files.pythonhosted.org/[^\"#]*flashinfer_python-${version}.tar.gz" | head -1)
[ -n "$url" ] || { echo "no sdist of flashinfer-python ${version} on PyPI" >&2; exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
curl -fsSL -o "$scratch/fi.tar.gz" "$url"
tar xzf "$scratch/fi.tar.gz" -C "$scratch"
src="$scratch/flashinfer_python-${version}"
rm -rf .fi
mkdir -p .fi/3rdparty .fi/flashinfer
cp -r "$src/flashinfer" "$src/csrc" "$src/include" "$src/tvm_binding" .fi/
cp -r "$src/3rdparty/cutlass" "$src/3rdparty/spdlog" .fi/3rdparty/
mkdir -p .fi/flashinfer/data
ln -s ../../csrc .fi/flashinfer/data/csrc
ln -s ../../include .fi/flashinfer/data/include
ln -s ../../3rdparty/cutlass .fi/flashinfer/data/cutlass
ln -s ../../3rdparty/spdlog .fi/flashinfer/data/spdlog
ln -s ../../tvm_binding .fi/flashinfer/data/tvm_binding
echo "built .fi/ ($(du -sh .fi | cut -f1)) from $url"
