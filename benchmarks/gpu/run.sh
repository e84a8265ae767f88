#!/usr/bin/env bash
# The prepared device script (docs/scale.md, "On a GPU"): every operation on --device (default cuda) in float32 and
# bfloat16 vs the CPU in float32, and the timings against the floor. Arguments go to run.py, e.g.
#   bash benchmarks/gpu/run.sh --out gpu.json
#   bash benchmarks/gpu/run.sh --device cpu --size small --models demo --out cpu.json
set -euo pipefail
exec python "$(dirname "$0")/run.py" "$@"
