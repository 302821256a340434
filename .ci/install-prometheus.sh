#!/bin/sh
# Installs Debian's prometheus package (prometheus + promtool) for tests/e2e/test_prometheus.py.
# Idempotent: nothing to do when /usr/bin/prometheus exists. Never fails the build: when
# apt cannot install it (no root, no network), the test skips and says why.
if [ -x /usr/bin/prometheus ] && [ -x /usr/bin/promtool ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 && SUDO="sudo -n" || {
        echo "install-prometheus: not root and no sudo; tests/e2e/test_prometheus.py will skip" >&2
        exit 0
    }
fi
export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get update -qq >/dev/null && \
   $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then
    # The package starts a system service on machines with an init; tests run their own.
    $SUDO systemctl stop prometheus >/dev/null 2>&1 || true
    echo "install-prometheus: $(/usr/bin/prometheus --version 2>&1 | head -n 1)"
else
    echo "install-prometheus: apt-get could not install prometheus;" \
         "tests/e2e/test_prometheus.py will skip" >&2
fi
exit 0
