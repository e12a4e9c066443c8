#!/usr/bin/env bash
# System libraries Tandem needs besides Python packages: Mooncake's transfer engine links
# libibverbs.so.1 even for its TCP transport. Installs it with apt-get when it is missing and we
# can; otherwise says what to install and fails.
set -euo pipefail

if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
      echo "Tandem needs libibverbs1 (for the Mooncake KV transport): run 'apt-get install libibverbs1' as root" >&2
      exit 1
    fi
  fi
  echo "Installing libibverbs1 (needed by the Mooncake KV transport)..."
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
  exit 0
fi
echo "Tandem needs libibverbs.so.1 (rdma-core / libibverbs1) for the Mooncake KV transport; install it with your package manager" >&2
exit 1
