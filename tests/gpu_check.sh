#!/usr/bin/env bash
# Every CUDA check of fp4pass in one go, for a machine with a GPU (under 8 minutes on one H100/H200):
#     bash tests/gpu_check.sh OUT_DIR [extra pytest flags]
# It writes OUT_DIR/gpu_check.log (every step's output), OUT_DIR/summary.json (what each step found) and the
# files the steps leave beside them (pytest.xml, qmoe_cuda.json, bench_*.json), one line per step on stdout.
#   install     onnxruntime-gpu from carried parts, when $FP4PASS_ORT_PARTS (default /tmp/ort-gpu) holds part-*,
#               NAME and SHA256SUMS (docs/testing.md): joined, checked against SHA256SUMS (a mismatch stops the
#               script, exit 2), pip-installed into $FP4PASS_ORT_SITE (default /tmp/ort-site) put first on
#               PYTHONPATH, then onnxruntime.preload_dlls(). Without parts: "CUDA EP absent" unless installed.
#   transformers  a carried .gpu_wheels/transformers-*.whl when the installed one is older than 5.24
#   env         torch, CUDA device, onnxruntime build and whether its CUDA EP really runs (env.json)
#   pytest      every test marked gpu or ort_cuda (pytest.xml)
#   qmoe        fp4pass's QMoE nvfp4 on onnxruntime's CUDA QMoE kernel (tests/qmoe_cuda_check.py)
#   bench       the calibrate-checkpoint bench on CUDA at gpt-oss-20b shapes (bench_calibrate.json)
#   bench_diff  the checkpoint diff bench on CUDA (gpt-oss-20b shapes against one calibration; bench_diff.json)
#   bench_quick the formats and fx benches on CUDA at --quick sizes (bench_quick.json)
# $FP4PASS_GPU_CHECK_STEPS (comma-separated names, default all) runs only those steps; the whole run has
# $FP4PASS_GPU_CHECK_SECONDS (default 450): a step that would start with under 10 s left is recorded as not run.
# Python: $PYTHON, else .venv/bin/python when there is one, else python3. Exit 0 when every step exits 0,
# 2 when the carried onnxruntime-gpu is damaged, else 1.
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: tests/gpu_check.sh OUT_DIR [extra pytest flags]" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
ROOT=$PWD
LOG="$OUT/gpu_check.log"
STEPS="$OUT/steps.tsv"
: >"$LOG"
: >"$STEPS"
PARTS=${FP4PASS_ORT_PARTS:-/tmp/ort-gpu}
SITE=${FP4PASS_ORT_SITE:-/tmp/ort-site}
ONLY=",${FP4PASS_GPU_CHECK_STEPS:-all},"
BUDGET=${FP4PASS_GPU_CHECK_SECONDS:-450}  # the whole run: each step gets at most what is left of it
DEADLINE=$((SECONDS + BUDGET))
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

wanted() { [ "$ONLY" = ",all," ] || [[ "$ONLY" == *",$1,"* ]]; }

record() {  # record NAME RC SECONDS NOTE: one row of steps.tsv and one line on stdout
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$STEPS"
  echo "gpu_check: $1: exit $2 in $3 s${4:+ ($4)}"
}

step() {  # step NAME SECONDS COMMAND...: COMMAND under a time limit (and the run's), its output in the log
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  wanted "$name" || return 0
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 10 ]; then
    record "$name" 124 0 "not run: the run's $BUDGET s were spent"
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name: $*" >>"$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  local note=""
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && note="stopped after $limit s"
  record "$name" "$rc" "$((SECONDS - start))" "$note"
  return 0
}

summarize() {
  "$PY" "$ROOT/tests/gpu_check_summary.py" "$OUT" >>"$LOG" 2>&1 ||
    echo "gpu_check: the summary could not be written (see $LOG)" >&2
}

install_ort_gpu() {  # sets ORT_NOTE; returns 2 when the carried wheel is damaged or does not install
  if [ ! -f "$PARTS/NAME" ]; then
    ORT_NOTE="no carried onnxruntime-gpu in $PARTS (NAME missing): CUDA EP absent unless already installed"
    return 0
  fi
  local name
  name=$(tr -d '[:space:]' <"$PARTS/NAME")
  case "$name" in
    *.whl) ;;
    *) echo "gpu_check: $PARTS/NAME: '$name' is not a wheel's file name" >&2; return 2 ;;
  esac
  if [[ "$name" == */* ]]; then echo "gpu_check: $PARTS/NAME: '$name' is not a bare file name" >&2; return 2; fi
  if ! compgen -G "$PARTS/part-*" >/dev/null; then
    echo "gpu_check: $PARTS: no part-* files beside NAME; carry the parts again" >&2
    return 2
  fi
  if [ ! -f "$PARTS/SHA256SUMS" ]; then
    echo "gpu_check: $PARTS/SHA256SUMS missing: the joined wheel cannot be checked; carry it again" >&2
    return 2
  fi
  cat "$PARTS"/part-* >"$PARTS/$name" || return 2
  if ! (cd "$PARTS" && sha256sum --check --status SHA256SUMS); then
    echo "gpu_check: $PARTS/$name: SHA-256 of the joined parts does not match SHA256SUMS (a part is missing," \
         "damaged or from another wheel); carry the five parts again" >&2
    return 2
  fi
  echo "installing $name into $SITE" >>"$LOG"
  if ! "$PY" -m pip install -q --no-deps --no-index --upgrade --target "$SITE" "$PARTS/$name" >>"$LOG" 2>&1; then
    echo "gpu_check: pip could not install $PARTS/$name into $SITE (see $LOG)" >&2
    return 2
  fi
  export PYTHONPATH="$SITE:$PYTHONPATH"
  if ! "$PY" - "$OUT/ort.json" >>"$LOG" 2>&1 <<'PY'
import json, sys
import onnxruntime as ort
ort.preload_dlls()  # the CUDA and cuDNN libraries of the nvidia-* packages; else the CUDA EP may not find them
found = {"version": ort.__version__, "file": ort.__file__, "providers": ort.get_available_providers()}
json.dump(found, open(sys.argv[1], "w"))
print(found)
PY
  then
    echo "gpu_check: the installed onnxruntime-gpu does not import (see $LOG)" >&2
    return 2
  fi
  ORT_NOTE="onnxruntime-gpu from $name"
  return 0
}

if wanted install; then
  start=$SECONDS
  ORT_NOTE=""
  install_ort_gpu 2>"$OUT/install.err"
  rc=$?
  cat "$OUT/install.err" >>"$LOG"
  cat "$OUT/install.err" >&2
  rm -f "$OUT/install.err"
  record install "$rc" "$((SECONDS - start))" "$ORT_NOTE"
  if [ "$rc" != 0 ]; then
    summarize
    exit 2
  fi
fi

# transformers >= 5.24 has the three checkpoint families; an older one (a machine's image) takes a carried wheel:
#   pip download --no-deps transformers==5.24.0 -d .gpu_wheels   (here), then carry .gpu_wheels
if wanted transformers; then
  start=$SECONDS
  recent='import sys, transformers; sys.exit(tuple(map(int, transformers.__version__.split(".")[:2])) < (5, 24))'
  note="installed one is recent enough"
  rc=0
  if ! "$PY" -c "$recent" >>"$LOG" 2>&1; then
    wheel=$(ls .gpu_wheels/transformers-*.whl 2>/dev/null | head -1)
    if [ -n "$wheel" ] && "$PY" -m pip install --no-deps --no-index -q --target /tmp/fp4pass-gpu-tf "$wheel" \
         >>"$LOG" 2>&1; then
      export PYTHONPATH="/tmp/fp4pass-gpu-tf:$PYTHONPATH"
      note="carried $(basename "$wheel")"
    else
      rc=1
      note="transformers < 5.24 and no .gpu_wheels/transformers-*.whl: the checkpoint tests will fail"
    fi
  fi
  record transformers "$rc" "$((SECONDS - start))" "$note"
fi

step env 60 "$PY" - "$OUT/env.json" <<'PY'
import json, sys
import torch
import onnxruntime as ort
if hasattr(ort, "preload_dlls"):
    ort.preload_dlls()
from fp4pass.onnx.runtime import cuda_available, installed_runtimes
try:
    ok, why = cuda_available()
except Exception as exc:  # an onnxruntime that cannot even make a session: say so, keep the rest
    ok, why = False, f"fp4pass's probe failed: {type(exc).__name__}: {exc}"
env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_device": None,
       "onnxruntime": ort.__version__, "onnxruntime_file": ort.__file__, "runtimes": installed_runtimes(),
       "available_providers": ort.get_available_providers(), "cuda_ep": ok, "cuda_ep_reason": why}
if torch.cuda.is_available():
    env["cuda_device"] = torch.cuda.get_device_name()
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env, indent=1))
PY

step pytest 240 "$PY" -m pytest -q -rs -p no:cacheprovider -m "gpu or ort_cuda" --junitxml "$OUT/pytest.xml" tests "$@"
step qmoe 90 "$PY" tests/qmoe_cuda_check.py --json "$OUT/qmoe_cuda.json"
# the benches on the CUDA device only (fp4pass bench --device cuda would run every one on the CPU first)
BENCH='import json, sys, torch
from fp4pass.bench import format_row
import fp4pass.bench.calibrate_checkpoint, fp4pass.bench.diff_checkpoint, fp4pass.bench.formats, fp4pass.bench.fx
quick = sys.argv[2] == "quick"
modules = {"quick": [fp4pass.bench.formats, fp4pass.bench.fx], "full": [fp4pass.bench.calibrate_checkpoint],
           "diff": [fp4pass.bench.diff_checkpoint]}[sys.argv[2]]
assert torch.cuda.is_available(), "no CUDA device: the CUDA benches cannot run here"
results = []
for module in modules:
    for bench in module.BENCHMARKS:
        for result in bench(torch.device("cuda"), quick):
            result.quick = quick
            print(format_row(result), flush=True)
            results.append(result.to_json())
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, open(sys.argv[1], "w"), indent=1)'
step bench 150 "$PY" -c "$BENCH" "$OUT/bench_calibrate.json" full
step bench_diff 90 "$PY" -c "$BENCH" "$OUT/bench_diff.json" diff
step bench_quick 45 "$PY" -c "$BENCH" "$OUT/bench_quick.json" quick

summarize
"$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["verdict"])' "$OUT/summary.json" 2>/dev/null
failed=$(awk -F'\t' '$2 != 0' "$STEPS" | wc -l)
[ "$failed" = 0 ]
