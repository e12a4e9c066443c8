#!/bin/sh
# Install torch==VERSION for ACCELERATOR (cpu|cuda) into the active Python environment.
#   install-torch.sh ACCELERATOR VERSION INDEX_URL WHEELS_DIR
# A matching wheel in WHEELS_DIR (same version, this Python's tag, "+cpu" build for cpu) wins, with
# its dependencies from the default index; otherwise torch comes from INDEX_URL (the PyTorch index
# for that accelerator, e.g. https://download.pytorch.org/whl/cpu or .../cu128).
set -eu
accelerator=$1 version=$2 index_url=$3 wheels_dir=$4
tag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
case "$accelerator" in
  cpu) pattern="torch-${version}+cpu-${tag}-${tag}-*.whl" ;;
  cuda) pattern="torch-${version}*-${tag}-${tag}-*.whl" ;;
  *) echo "install-torch.sh: accelerator must be cpu or cuda, got '$accelerator'" >&2; exit 2 ;;
esac
wheel=""
for candidate in "$wheels_dir"/$pattern; do
  case "$candidate" in *+cpu-*) [ "$accelerator" = cuda ] && continue ;; esac
  [ -f "$candidate" ] && wheel=$candidate && break
done
if [ -n "$wheel" ]; then
  echo "install-torch.sh: torch from $wheel"
  pip install --no-cache-dir "$wheel"
else
  echo "install-torch.sh: torch==$version from $index_url"
  pip install --no-cache-dir --index-url "$index_url" "torch==$version"
fi
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
