"""``pdserve bench``'s multi-turn workload without a server: conversations built from a
seed, each turn's prompt grown from the last prompt, the answer the server gave and a new
user message; and the scale benchmarks' per-request goodput."""
from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.bench import datasets, metrics, multi_turn, runner
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.multi_turn import MultiTurnSpec


def test_goodput_per_request_slo():
    result = {"duration": 2.0,
              "ttfts": [0.1, 0.5, 0.1, 0.1, 0.0],
              # the third's p99 gap is 0.01 + 0.99 * 0.99 s: over a 0.05 s SLO
              "itls": [[0.01, 0.02], [0.01], [0.01, 1.0], [], []],
              "errors": ["", "", "", "", "HTTP 500"]}
    # good: the first (all within) and the fourth (one chunk: no gap to judge)
    assert metrics.goodput(result, 0.2, 0.05) == pytest.approx(2 / 2.0)
    assert metrics.goodput(result, 1.0, 2.0) == pytest.approx(4 / 2.0)
    assert metrics.goodput({**result, "duration": 0.0}, 1.0, 1.0) == 0.0


def spec(**kw):
    return MultiTurnSpec(**{"turns": 3, "system_len": 16, "user_len": 8, "output_len": 4,
                            "shared_system": 2, **kw})


def test_conversations_ids(tiny_model):
    tok = datasets.load_tokenizer(tiny_model("llama"))
    convs = multi_turn.conversations(tok, 10, spec(), seed=5)
    # 10 requests: 3 + 3 + 3 + 1 turns
    assert [len(c.users) for c in convs] == [3, 3, 3, 1]
    assert all(len(u) == 8 for c in convs for u in c.users)
    assert all(n == 4 for c in convs for n in c.output_lens)
    # groups of two share a system prompt; the groups' differ; users' all differ
    systems = [tuple(c.system) for c in convs]
    assert systems[0] == systems[1] != systems[2] == systems[3] and len(systems[0]) == 16
    users = [tuple(u) for c in convs for u in c.users]
    assert len(set(users)) == len(users)
    assert not set().union(*users, *systems) & tok.special_ids
    again = multi_turn.conversations(tok, 10, spec(), seed=5)
    assert [c.users for c in again] == [c.users for c in convs]


def test_a_turn_resends_the_history_with_the_answer(tiny_model):
    tok = datasets.load_tokenizer(tiny_model("llama"))
    (conv,) = multi_turn.conversations(tok, 3, spec(), seed=1)

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    first = conv.next_request()
    assert first.prompt == conv.system + conv.users[0] and first.prompt_len == 24
    # over HTTP the answer is text, encoded again; the ingress gives its ids
    conv.add_answer(first, "hello there", None, encode)
    second = conv.next_request()
    answer = encode("hello there")
    assert second.prompt == first.prompt + answer + conv.users[1]
    assert second.prompt_len == 24 + len(answer) + 8
    conv.add_answer(second, "ignored", [7, 8, 9], encode)
    third = conv.next_request()
    assert third.prompt == second.prompt + [7, 8, 9] + conv.users[2]
    conv.add_answer(third, "", [], encode)  # a failed turn's answer: what arrived, nothing
    assert conv.done


def test_chat_history_is_messages(tiny_model):
    tok = datasets.load_tokenizer(tiny_model("llama"))
    (conv,) = multi_turn.conversations(tok, 2, spec(), seed=2, chat=True)

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    first = conv.next_request()
    assert [m["role"] for m in first.prompt] == ["system", "user"]
    assert first.prompt_len == len(encode(conv.system)) + len(encode(conv.users[0]))
    conv.add_answer(first, "sure, here it is", None, encode)
    second = conv.next_request()
    assert second.prompt[:2] == first.prompt
    assert second.prompt[2:] == [{"role": "assistant", "content": "sure, here it is"},
                                 {"role": "user", "content": conv.users[1]}]
    assert second.prompt_len == first.prompt_len + len(encode("sure, here it is")) + \
        conv.user_tokens[1]
    no_system = multi_turn.conversations(tok, 1, spec(system_len=0), chat=True)[0]
    assert [m["role"] for m in no_system.next_request().prompt] == ["user"]


@pytest.mark.parametrize("kw, words", [
    ({"turns": 0}, "--multi-turn-turns must be at least 1"),
    ({"user_len": 0}, "--multi-turn-user-len must be at least 1"),
    ({"system_len": -1}, "--multi-turn-system-len must be at least 0"),
    ({"shared_system": 0}, "--multi-turn-shared-system must be at least 1"),
    ({"user_len": 1, "range_ratio": 0.5}, "leaves user messages with no token"),
])
def test_spec_checked(kw, words):
    with pytest.raises(ValueError, match=words):
        spec(**kw).check()
    assert spec(turns=4, user_len=10, output_len=5).longest_prompt() == 16 + 40 + 15


class Echo:
    """A backend that answers each prompt with its length, after a short sleep; it
    checks that no conversation has two turns in flight."""

    def __init__(self):
        self.sent, self.busy = [], set()

    async def send(self, req):
        key = tuple(req.prompt[:16])  # the system prompt: one conversation each here
        assert key not in self.busy
        self.busy.add(key)
        start = time.perf_counter()
        await asyncio.sleep(0.01)
        self.busy.discard(key)
        self.sent.append(req)
        now = time.perf_counter()
        return RequestRecord(req.prompt_len, start, now, [now], output_tokens=1,
                             success=True, generated_text="", output_ids=[req.prompt_len])


def test_run_conversations_in_order(tiny_model):
    tok = datasets.load_tokenizer(tiny_model("llama"))
    convs = multi_turn.conversations(tok, 8, spec(turns=3, shared_system=1), seed=0)
    echo = Echo()
    records, keys, duration = asyncio.run(runner.run_conversations(
        echo, convs, lambda t: [], max_concurrency=2, progress=False))
    assert keys == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    assert len(echo.sent) == 8 and all(r.success for r in records)
    # each turn's prompt: the one before, the answer (its length as one id), the user's
    lens = [r.prompt_len for r in records]
    assert lens[:3] == [24, 24 + 1 + 8, 33 + 1 + 8]
    assert min(r.start for r in records) >= 0 and duration > 0


def test_merge_results_of_clients_side_by_side():
    """Two clients' results (one per router) make one: requests together, the longer
    duration, figures computed again; conversations numbered apart."""
    from pdserve.bench import report

    def one(ttfts, duration):
        recs = [RequestRecord(10, start=0.0, end=t + 0.2, chunk_times=[t, t + 0.1, t + 0.2],
                              output_tokens=3, success=True) for t in ttfts]
        m = metrics.compute_metrics(recs, duration, [99])
        return report.result_dict(m, recs, ("ttft", "itl"), num_prompts=len(recs),
                                  conversation_index=[0] * len(recs),
                                  turn_index=list(range(len(recs))))

    merged = report.merge_results([one([0.1, 0.2], 2.0), one([0.3], 3.0)], [50])
    assert merged["completed"] == 3 and merged["num_prompts"] == 3
    assert merged["duration"] == 3.0 and merged["request_throughput"] == pytest.approx(1.0)
    assert merged["ttfts"] == pytest.approx([0.1, 0.2, 0.3])
    assert merged["median_ttft_ms"] == pytest.approx(200)
    assert merged["conversation_index"] == [0, 0, 1] and merged["turn_index"] == [0, 1, 0]
