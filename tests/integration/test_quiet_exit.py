"""Stopping a server prints nothing but pdserve's own lines.

On a CPU machine no process can launch a Triton kernel, so none imports triton, whose
nanobind bindings otherwise print ~30 "leaked type/function" lines at every exit. The
tests' own TRITON_INTERPRET (tests/conftest.py) is what loads it for the kernel tests, so
the cluster here runs without it, as `make serve` does.
"""
from __future__ import annotations

import os
import re
import signal

import pytest

# Every line a pdserve process writes: a log record ("2026-12-03 19:20:41,399 INFO ..."),
# or launch's own table and its last word.
OURS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ |pdserve |  |\s*http://|"
                  r"Ctrl-C stops everything)")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stopping_launch_prints_only_our_lines(tiny_model, monkeypatch, sig):
    from tests.cluster import launched

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with launched(tiny_model()) as cluster:
        cluster.metrics_urls()  # the table is out: every child is up
        cluster.proc.send_signal(sig)
        assert cluster.proc.wait(timeout=60) == 0
    log = cluster.log()
    assert not os.path.exists(cluster.log_path)  # its temporary log is not left behind
    assert "leaked" not in log and "nanobind" not in log, log[-3000:]
    strangers = [line for line in log.splitlines() if line and not OURS.match(line)]
    assert strangers == [], log[-3000:]
