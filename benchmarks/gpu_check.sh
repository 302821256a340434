#!/usr/bin/env bash
# The CUDA path in one go, for the first machine with a GPU (under 8 minutes on one):
#   1. every Triton kernel against its torch reference on CUDA (gpu_check_kernels.py)
#   2. greedy output against transformers on CUDA, float32 (gpu_check_greedy.py)
#   3. `pdserve launch` 1P1D on the GPU, the seed workload through `pdserve bench`
#      (concurrency 16, 1024 tokens in, 128 out, 128 prompts; vLLM's report)
# Everything goes to one results file (default gpu_check_results.txt; the bench's JSON
# beside it). Exit status 1 on any mismatch or failed request, 0 when all passed.
# Before them, every kernel is compiled for sm_80 and sm_90 (`pdserve kernels compile`).
# Without CUDA it says so, runs the CPU-safe parts (the compile, the kernel check under
# the Triton interpreter, the greedy check on the CPU) and exits 0 unless one fails.
#
# On a bare GPU machine (its own Python 3.12 with torch and Triton, no network, no venv):
# run benchmarks/gpu_wheels.sh on a machine with pip access first and bring .whl/ along;
# the wheels this Python lacks (or has older) go into a temporary site on PYTHONPATH,
# for this script and every process it starts, and are gone when it ends.
#
#   benchmarks/gpu_check.sh [RESULTS_FILE]   (PYTHON=... the interpreter, WHEEL_DIR=... the wheels)
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${1:-gpu_check_results.txt}
: > "$OUT"
status=0
SITE=""
LAUNCH=""
cleanup() {
    [ -n "$LAUNCH" ] && stop_launch
    [ -n "$SITE" ] && rm -rf "$SITE"
}
trap cleanup EXIT
# pdserve from this checkout, whether or not it is installed, in every process started here
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "$*" | tee -a "$OUT"; }
step() {  # step NAME TIMEOUT_S CMD...: runs CMD, its output into the results file
    local name=$1 limit=$2; shift 2
    say "== $name"
    local t0=$SECONDS
    if timeout "$limit" "$@" 2>&1 | grep -v -e '^Loading weights' | tee -a "$OUT"; then
        say "== $name: passed ($((SECONDS - t0)) s)"
    else
        say "== $name: FAILED ($((SECONDS - t0)) s)"
        status=1
    fi
}

say "pdserve GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

WHEELS=${WHEEL_DIR:-.whl}
if [ -d "$WHEELS" ] && ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    say "not using $WHEELS: its wheels are for CPython 3.12, $PY is $("$PY" -V 2>&1)"
elif [ -d "$WHEELS" ]; then
    glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | cut -d' ' -f2)
    case "$glibc" in 2.[0-9]|2.[12][0-9]|2.30)
        say "WARNING glibc $glibc: llguidance's wheel needs 2.31 (structured output would fail)";;
    esac
    need=$("$PY" - "$WHEELS" <<'EOF'
import importlib.metadata as md, pathlib, sys
try:
    from packaging.version import Version
except ImportError:  # then any other version counts as older
    Version = None
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        print(wheel)
        continue
    if (Version(have) < Version(version)) if Version else have != version:
        print(wheel)
EOF
)
    if [ -n "$need" ]; then
        SITE=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-site.XXXXXX")
        # shellcheck disable=SC2086  # one wheel path per word
        if "$PY" -m pip --version >/dev/null 2>&1; then
            "$PY" -m pip install -q --no-deps --no-index --target "$SITE" $need
        else  # no pip: a wheel is a zip of its site-packages files
            "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" $need
        fi || { say "FAIL installing the wheels of $WHEELS into $SITE"; exit 1; }
        export PYTHONPATH="$SITE:$PYTHONPATH"
        say "installed from $WHEELS into $SITE: $(for w in $need; do basename "$w" | cut -d- -f1-2; done | tr '\n' ' ')"
    fi
fi
if ! "$PY" -c 'import torch' 2>/dev/null; then
    say "FAIL $PY has no torch: the GPU machine's Python brings torch and Triton itself"
    exit 1
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$OUT"
import os, torch
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = "not installed"
print(f"torch {torch.__version__}, triton {tv}, {os.cpu_count()} CPUs, {dev}")
EOF

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    say "NO CUDA DEVICE: the GPU checks cannot run on this machine. Running the CPU-safe parts."
    step "Triton kernels compiled for sm_80 and sm_90" 300 \
        env -u TRITON_INTERPRET "$PY" -m pdserve.cli kernels compile --arch 80,90
    step "Triton kernels vs torch (CPU, TRITON_INTERPRET=1, small cases)" 600 \
        env TRITON_INTERPRET=1 "$PY" benchmarks/gpu_check_kernels.py --device cpu
    step "greedy vs transformers (CPU, float32)" 600 \
        "$PY" benchmarks/gpu_check_greedy.py --device cpu --new-tokens 16
    say "skipped: Triton on CUDA, greedy on CUDA, pdserve launch + bench on the GPU"
    say "result: $([ $status = 0 ] && echo 'CPU-safe parts passed' || echo 'FAILED'); see $OUT"
    exit $status
fi

step "Triton kernels compiled for sm_80 and sm_90" 120 \
    env -u TRITON_INTERPRET "$PY" -m pdserve.cli kernels compile --arch 80,90
step "Triton kernels vs torch on CUDA" 240 env TRITON_INTERPRET=0 "$PY" benchmarks/gpu_check_kernels.py --device cuda
step "greedy vs transformers on CUDA, float32" 180 env TRITON_INTERPRET=0 "$PY" benchmarks/gpu_check_greedy.py --device cuda

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
HTTP=$(free_port); CONTROL=$(free_port); INGRESS=$(free_port)
LOG=${OUT%.txt}-launch.log
say "== pdserve launch --prefill 1 --decode 1 --node-arg=--device=cuda (log: $LOG)"
TRITON_INTERPRET=0 setsid "$PY" -m pdserve.cli launch --prefill 1 --decode 1 --node-arg=--device=cuda \
    --http-port "$HTTP" --control "tcp://127.0.0.1:$CONTROL" --ingress "tcp://127.0.0.1:$INGRESS" \
    --log-level warning > "$LOG" 2>&1 &
LAUNCH=$!
stop_launch() {
    kill -TERM "$LAUNCH" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$LAUNCH" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$LAUNCH" 2>/dev/null  # the launcher's process group, if anything is left
    wait "$LAUNCH" 2>/dev/null
    LAUNCH=""
}
ready=0
for _ in $(seq 240); do
    if "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' \
        "http://127.0.0.1:$HTTP/health" 2>/dev/null; then ready=1; break; fi
    kill -0 "$LAUNCH" 2>/dev/null || break
    sleep 0.5
done
if [ $ready = 1 ]; then
    JSON=${OUT%.txt}-bench.json
    step "pdserve bench: 128 prompts, concurrency 16, 1024 in, 128 out" 300 \
        "$PY" -m pdserve.cli bench --base-url "http://127.0.0.1:$HTTP" --num-prompts 128 \
        --max-concurrency 16 --random-input-len 1024 --random-output-len 128 --ignore-eos \
        --disable-tqdm --save-result --result-dir "$(dirname "$JSON")" \
        --result-filename "$(basename "$JSON")"
    if ! "$PY" -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(0 if r.get("completed") == 128 else 1)' "$JSON" 2>/dev/null; then
        say "FAIL the bench did not complete all 128 requests (see $JSON)"
        status=1
    fi
else
    say "FAIL pdserve launch did not become healthy; its log:"
    tail -40 "$LOG" | tee -a "$OUT"
    status=1
fi
stop_launch
say "result: $([ $status = 0 ] && echo 'all GPU checks passed' || echo 'FAILED'); see $OUT"
exit $status
