#!/bin/sh
# Installs Debian's gcc when no C compiler is on PATH: pdserve's native CPU kernels
# (pdserve/kernels/native) are built with `cc` on first use, and their tests skip
# without one. Idempotent; never fails the build (without it the torch kernels serve,
# and the tests say why they skipped).
if command -v cc >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 && SUDO="sudo -n" || {
        echo "install-cc: not root and no sudo; the native kernels' tests will skip" >&2
        exit 0
    }
fi
export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get update -qq >/dev/null && \
   $SUDO apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null; then
    echo "install-cc: $(cc --version 2>&1 | head -n 1)"
else
    echo "install-cc: apt-get could not install gcc; the native kernels' tests will skip" >&2
fi
exit 0
