#!/usr/bin/env bash
# The GPU device check in one command (docs/gpu.md, "The device check"), run from the
# repository root on the GPU machine with .devcheck carried beside it:
#
#     bash benchmarks/gpu_device_check.sh [--quick] [--steps env,tests,...]
#
# Results go to $OUT (else ./gpu-check-out): gpu_check.json, gpu_check.md, gpu_check.log.
# Whatever has run when the 8-minute limit strikes is already written there.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec timeout --kill-after=10 480 python3 benchmarks/gpu_device_check.py run "$@"
