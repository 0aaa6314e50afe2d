# streamgr on CUDA 13: a CUDA build of torch, CuPy and numba-cuda, and the CUDA headers NVRTC
# needs at run time to compile cuda_kernels/*.cu (cuda_bf16.h, mma.h): the devel image has them.
#   docker build -t streamgr .
#   docker run --gpus all -p 7700:7700 -p 9100:9100 streamgr \
#       serve rank-ref --host 0.0.0.0 --metrics-port 9100
# Layers from least to most often changed: a code change reinstalls neither torch nor CuPy.
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04

# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip curl \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda

# The heavy dependencies first, pinned to what the code is tested with.
RUN pip install --no-cache-dir torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130
RUN pip install --no-cache-dir cupy-cuda13x==14.2.0 numba-cuda==0.30.4 numpy==2.4.6 \
        msgspec==0.23.0 uvloop==0.22.1 safetensors==0.7.0

WORKDIR /opt/streamgr
COPY pyproject.toml README.md ./
COPY streamgr ./streamgr
COPY cuda_kernels ./cuda_kernels
COPY pipeline ./pipeline
RUN pip install --no-cache-dir --no-deps .

RUN useradd --create-home --uid 10001 streamgr
USER 10001

# 7700: the msgspec socket protocol; 9100: /metrics, /health, /ready (--metrics-port 9100).
EXPOSE 7700 9100
# Live when /health answers (a server started with --metrics-port 9100).
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:9100/health"]
ENTRYPOINT ["streamgr"]
CMD ["demo"]
