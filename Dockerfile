# The image the Kubernetes manifests (k8s/) run: `pdserve` as the entrypoint, the CPU build of torch,
# and the built-in default model (a small Llama trained on Python's standard library) at
# /opt/pdserve/default_model/default so a fresh cluster serves something.
# GPU image: build with --build-arg TORCH_SPEC="torch==2.13.0" --build-arg TORCH_INDEX=<a CUDA wheel index>.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# g++: the paged-attention kernel and torch.compile's CPU backend build native code on first use
# (cached per user under ~/.cache); without a compiler the workers fall back to plain-torch attention.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pdserve
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
RUN pip install . && pdserve default-model /opt/pdserve/default_model/default

RUN useradd --create-home --uid 1000 pdserve
USER pdserve
EXPOSE 8000 8001
ENTRYPOINT ["pdserve"]
CMD ["up", "--host", "0.0.0.0", "--model", "/opt/pdserve/default_model/default"]
