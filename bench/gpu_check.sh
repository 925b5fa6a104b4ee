#!/usr/bin/env bash
# The first run on a GPU machine, offline, with the python3 it has (no pip):
#     bash bench/gpu_check.sh [--key=value ...]
# bench/gpu_check.py says what runs; one table ends up in $GPU_CHECK_DIR/table.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
exec "$PYTHON" bench/gpu_check.py "$@"
