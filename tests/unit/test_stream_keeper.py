"""What a decode node keeps of its streams for a resume (node/streams.py): the bounds in
time, streams and tokens, and who finds what. Pure data, no process."""
from __future__ import annotations

from pdserve.common import protocol as P
from pdserve.common.sampling import SamplingParams
from pdserve.node import streams as K


def origin(client_id: str, owner: str = "70") -> P.StreamOrigin:
    return P.StreamOrigin(owner=owner, client_id=client_id, num_prompt=2,
                          sampling=SamplingParams(max_tokens=4))


def test_ended_streams_are_kept_within_their_bounds_oldest_first(monkeypatch):
    monkeypatch.setattr(K, "MAX_KEPT_STREAMS", 3)
    monkeypatch.setattr(K, "MAX_KEPT_TOKENS", 10)
    keeper = K.StreamKeeper(keep_s=30.0)
    for i in range(4):  # 4 streams of 3 tokens: the first goes (count), ...
        keeper.started(f"w{i}", origin(f"c{i}"))
        keeper.finished(f"w{i}", origin(f"c{i}"), [1, 2, 3], "length", now=float(i))
    assert list(keeper.ended) == ["w1", "w2", "w3"] and keeper.num_kept_tokens == 9
    assert keeper.find("70", "c0") is None and keeper.find("70", "c3") == "w3"
    keeper.started("w4", origin("c4"))
    keeper.finished("w4", origin("c4"), [1, 2, 3, 4, 5], "stop", now=4.0)  # ... and tokens
    assert list(keeper.ended) == ["w3", "w4"] and keeper.num_kept_tokens == 8
    assert keeper.find("70", "c1") is None and keeper.find("71", "c4") is None  # its owner's


def test_orphans_and_ended_streams_go_after_keep_s_unless_resumed():
    keeper = K.StreamKeeper(keep_s=5.0)
    for w in ("run", "other"):
        keeper.started(w, origin(w))
        keeper.orphaned(w, now=100.0)
    keeper.started("done", origin("done"))
    keeper.finished("done", origin("done"), [1, 2, 3], "length", now=100.0)
    assert keeper.expired(104.0) == []
    keeper.adopted("other")  # a router took it over: nobody's orphan now
    assert keeper.expired(105.5) == ["run"]  # the caller aborts it (forget)
    assert keeper.find("70", "done") is None and keeper.num_kept_tokens == 0
    keeper.forget("run")
    assert keeper.find("70", "run") is None and keeper.find("70", "other") == "other"
    keeper.started("other~1", origin("other"))  # a new attempt of the same request
    assert keeper.find("70", "other") == "other~1"
