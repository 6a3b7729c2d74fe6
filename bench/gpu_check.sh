#!/usr/bin/env bash
# GPU check for a lent CUDA machine (<= 5 minutes): page copies vs the pinned peak,
# the streamed decode step vs its bound, and exactness on CUDA. See bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s install >/dev/null
PYTHONPATH=bench timeout 300 .venv/bin/python bench/gpu_check.py
