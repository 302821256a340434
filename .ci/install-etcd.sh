#!/bin/sh
# Installs Debian's etcd-server package (etcd) for tests/e2e/test_fleet.py, which starts
# its own etcd on free loopback ports (etcdctl, in etcd-client, is not needed: the tests
# read etcd through pdserve's own client). Idempotent: nothing to do when /usr/bin/etcd exists. Never fails the
# build: when apt cannot install it (no root, no network), the tests skip and say why.
if [ -x /usr/bin/etcd ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 && SUDO="sudo -n" || {
        echo "install-etcd: not root and no sudo; tests/e2e/test_fleet.py will skip" >&2
        exit 0
    }
fi
export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get update -qq >/dev/null && \
   $SUDO apt-get install -y -qq --no-install-recommends etcd-server >/dev/null; then
    # The package starts a system service on machines with an init; tests run their own.
    $SUDO systemctl stop etcd >/dev/null 2>&1 || true
    echo "install-etcd: $(/usr/bin/etcd --version 2>&1 | head -n 1)"
else
    echo "install-etcd: apt-get could not install etcd-server;" \
         "tests/e2e/test_fleet.py will skip" >&2
fi
exit 0
