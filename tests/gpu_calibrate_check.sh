#!/usr/bin/env bash
# Checkpoint calibration on a CUDA machine, in one go (a few minutes on one H100):
#   1. the gpu-marked tests of tests/test_checkpoint_calibrate.py (fp4pass's per-expert amax on CUDA against hooks
#      on transformers' own forward on CUDA, every bundled family);
#   2. the calibrate-checkpoint benchmark on CUDA at full size: gpt-oss-20b layer shapes against a plain bf16
#      forward in the same process, and peak RSS of 16 vs 4 layers.
# Python: $PYTHON, else .venv/bin/python when there is one, else python3. Extra pytest flags: "$@".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# transformers >= 5.24 has the three model families; an older one (a machine's image) takes a carried wheel:
#   pip download --no-deps transformers==5.24.0 -d .gpu_wheels   (here), then carry .gpu_wheels
recent='import sys, transformers; sys.exit(tuple(map(int, transformers.__version__.split(".")[:2])) < (5, 24))'
if ! "$PY" -c "$recent"; then
  wheel=$(ls .gpu_wheels/transformers-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || { echo "transformers < 5.24 and no .gpu_wheels/transformers-*.whl" >&2; exit 2; }
  "$PY" -m pip install --no-deps --no-index -q --target /tmp/fp4pass-gpu-tf "$wheel"
  export PYTHONPATH="/tmp/fp4pass-gpu-tf:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="${PYTHONPATH:-$PWD}"
"$PY" - <<'PY'
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device: nothing to check here"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
PY
"$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_checkpoint_calibrate.py "$@"
"$PY" - <<'PY'
import torch
from fp4pass.bench import format_row
from fp4pass.bench.calibrate_checkpoint import bench_against_forward, bench_depth_memory

for bench in (bench_against_forward, bench_depth_memory):
    for result in bench(torch.device("cuda"), False):
        print(format_row(result), flush=True)
PY
