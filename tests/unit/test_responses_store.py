"""The Responses store's bounds, without processes: at most max_entries (the oldest
dropped first), nothing past its TTL, every change of size reported (the
pdserve_responses_stored gauge), and 0 entries storing nothing."""
from __future__ import annotations

from pdserve.router.http import responses_store
from pdserve.router.http.responses_store import ResponsesStore


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_oldest_dropped_past_max_entries():
    sizes = []
    store = ResponsesStore(2, 60.0, sizes.append)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert store.get("r0") is None
    assert store.get("r2").history == [{"role": "user", "content": "2"}]
    assert len(store) == 2 and sizes == [1, 2, 2]


def test_expired_after_ttl(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(responses_store.time, "monotonic", clock)
    sizes = []
    store = ResponsesStore(10, 5.0, sizes.append)
    store.put({"id": "old"}, [])
    clock.now += 3
    store.put({"id": "new"}, [])
    clock.now += 2.5                      # old is 5.5 s old, new 2.5 s
    assert store.get("old") is None and store.get("new") is not None
    clock.now += 3
    assert store.get("new") is None and len(store) == 0
    assert sizes == [1, 2, 1, 0]


def test_zero_entries_stores_nothing():
    store = ResponsesStore(0, 60.0)
    store.put({"id": "r"}, [])
    assert store.get("r") is None and len(store) == 0


def test_bytes_bound_drops_the_oldest():
    big = [{"role": "user", "content": "x" * 1000}]
    store = ResponsesStore(100, 60.0, max_bytes=2500)
    for i in range(3):
        store.put({"id": f"r{i}"}, big)
    assert store.get("r0") is None and store.get("r2") is not None
    assert len(store) == 2 and store.num_bytes <= 2500
    store.put({"id": "huge"}, [{"role": "user", "content": "x" * 5000}])  # over it alone
    assert store.get("huge") is None and len(store) == 2
