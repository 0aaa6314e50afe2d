# streamgr on a CUDA 13 runtime: installs the package with its GPU extras (CuPy, numba-cuda).
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1

WORKDIR /opt/streamgr
COPY pyproject.toml README.md ./
COPY streamgr ./streamgr
COPY cuda_kernels ./cuda_kernels
COPY pipeline ./pipeline
RUN pip install --no-cache-dir '.[cuda]'

EXPOSE 7700
ENTRYPOINT ["streamgr"]
CMD ["demo"]
