"""Logprobs, echo, n and prompt lists through the OpenAI API, as a user checks them: the
openai client against `pdserve launch` (one prefill and one decode node, float32), every
logprob against transformers' log_softmax of the same checkpoint, n and prompt lists
against the same requests asked one by one; a seeded request's logprobs survive its decode
node's SIGKILL."""
from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
import torch

from pdserve import SamplingParams
from pdserve.router import streams as S
from tests.cluster import launched
from tests.e2e.test_failover_hardening import _kill
from tests.integration.test_router_core import Harness

TOL = 1e-3
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the " \
    "woods where nobody can find it again"
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                             dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is transformers' log_softmax of the token after position p."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with launched(model_dir, 1, 1) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def name(client):
    return client.models.list().data[0].id


def tokenize(cluster, text):
    return httpx.post(cluster.http_url + "/tokenize", json={"prompt": text}).json()["tokens"]


def tokenize_url(client, text):
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/tokenize"
    return httpx.post(url, json={"prompt": text}).json()["tokens"]


@pytest.fixture(scope="module")
def texts_of(model_dir):
    """Token ids -> each one's text alone, special tokens spelt out (vLLM's token texts)."""
    from pdserve.model.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    return lambda ids: [tok.decode([t], skip_special_tokens=False) for t in ids]


def check_sampled(hf, prompt_ids, out_ids, token_logprobs, tops, k, keyed_by_text=False):
    """Each sampled token's logprob, and its k most likely alternatives, equal transformers'.
    ``keyed_by_text``: tops come from a dict keyed by token text (completions), where
    tokens spelt alike share one entry, so only membership is checked."""
    ref = hf_logprobs(hf, prompt_ids + out_ids)
    for i, tok in enumerate(out_ids):
        row = ref[len(prompt_ids) + i - 1]
        assert abs(token_logprobs[i] - row[tok].item()) < TOL, i
        want = row.topk(k).values.tolist()
        if keyed_by_text:
            assert abs(max(tops[i]) - want[0]) < TOL and len(tops[i]) <= k + 1
            assert all(any(abs(a - b) < TOL for b in want + [token_logprobs[i]])
                       for a in tops[i]), i
        else:
            assert len(tops[i]) == k and all(abs(a - b) < TOL for a, b in zip(tops[i], want))


@pytest.fixture(scope="module")
def vocab_texts(model_dir):
    """Token text (as the API spells tokens) -> the ids with that text."""
    from pdserve.model.tokenizer import Tokenizer

    tok, out = Tokenizer(model_dir), {}
    for t in range(tok.vocab_size):
        out.setdefault(tok.decode([t], skip_special_tokens=False), []).append(t)
    return out


def test_completion_logprobs_equal_transformers(client, name, cluster, hf, vocab_texts):
    """First token from the prefill node, the rest from the decode node; greedy and
    sampled alike report the raw distribution (temperature and top_p change nothing)."""
    prompt_ids = tokenize(cluster, PROMPT)
    for extra in ({"temperature": 0}, {"temperature": 1.7, "seed": 5, "top_p": 0.9}):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, logprobs=3,
                                      extra_body=IGNORE_EOS, **extra)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
        ids = list(prompt_ids)
        for i, token in enumerate(lp.tokens):
            row = hf_logprobs(hf, ids)[-1]
            # the sampled token: the id with this text and this logprob under transformers
            found = [t for t in vocab_texts[token] if abs(row[t] - lp.token_logprobs[i]) < TOL]
            assert found, (i, token, lp.token_logprobs[i])
            ids.append(found[0])
            top = lp.top_logprobs[i]
            assert top[token] == lp.token_logprobs[i] and len(top) <= 4
            best = row.topk(3)
            for t, v in zip(best.indices.tolist(), best.values.tolist()):
                assert any(abs(top[x] - v) < TOL for x in top), (i, t)
        assert [x for x in lp.token_logprobs] == [max(x, -9999.0) for x in lp.token_logprobs]


def test_token_logprobs_by_ids_equal_transformers(client, name, hf):
    """Token-id prompts and greedy output: every logprob checked by id, with its top 5."""
    prompt_ids = [5, 17, 300, 42, 9, 77, 1000, 3, 12, 600, 250, 31, 4, 8, 90, 66, 21, 7]
    r = client.completions.create(model=name, prompt=prompt_ids, max_tokens=8, logprobs=5,
                                  temperature=0, extra_body=IGNORE_EOS)
    stream = client.completions.create(model=name, prompt=prompt_ids, max_tokens=8, logprobs=5,
                                       temperature=0, extra_body=IGNORE_EOS, stream=True)
    streamed = [lp for ch in stream for c in ch.choices if (lp := c.logprobs) is not None]
    ref_text = "".join(r.choices[0].logprobs.tokens)
    assert ref_text == r.choices[0].text or "\ufffd" in ref_text
    # Greedy: each token is its row's argmax, so ids follow from transformers' own run.
    ids = list(prompt_ids)
    for _ in range(8):
        ids.append(int(hf_logprobs(hf, ids)[-1].argmax()))
    out_ids = ids[len(prompt_ids):]
    lp = r.choices[0].logprobs
    tops = [list(t.values()) for t in lp.top_logprobs]
    check_sampled(hf, prompt_ids, out_ids, lp.token_logprobs, tops, 5, keyed_by_text=True)
    # (the second run reuses the prefix cache: the same values to float rounding)
    got = [x for s in streamed for x in s.token_logprobs]
    assert len(got) == 8 and max(abs(a - b) for a, b in zip(got, lp.token_logprobs)) < TOL
    assert [x for s in streamed for x in s.tokens] == lp.tokens


def test_chat_logprobs_equal_transformers(client, name, cluster, hf, texts_of):
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt_ids = httpx.post(cluster.http_url + "/tokenize",
                            json={"messages": messages}).json()["tokens"]
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    ids = list(prompt_ids)
    for _ in range(5):
        ids.append(int(hf_logprobs(hf, ids)[-1].argmax()))
    out = ids[len(prompt_ids):]
    check_sampled(hf, prompt_ids, out, [c.logprob for c in content],
                  [[t.logprob for t in c.top_logprobs] for c in content], 2)
    for c, tok, text in zip(content, out, texts_of(out)):
        assert c.token == text == c.top_logprobs[0].token  # greedy: the most likely
        assert c.bytes == list(text.encode("utf-8", errors="replace"))
    # Without top_logprobs: the tokens' own logprobs, no alternatives.
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=2,
                                       temperature=0, logprobs=True, extra_body=IGNORE_EOS)
    assert [c.top_logprobs for c in r.choices[0].logprobs.content] == [[], []]
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=2)
    assert r.choices[0].logprobs is None


def test_echo_prompt_logprobs_equal_transformers(client, name, cluster, hf, texts_of):
    """lm-eval's loglikelihood request (echo, max_tokens 1, logprobs 1), and max_tokens 0;
    asked twice, so the second time the prefill node holds the prompt in its prefix cache
    (it must compute the positions anyway)."""
    prompt_ids = tokenize(cluster, PROMPT)
    assert len(prompt_ids) > 32  # two full KV blocks: cacheable
    ref = hf_logprobs(hf, prompt_ids)
    want = [ref[i - 1, t].item() for i, t in enumerate(prompt_ids) if i]
    for max_tokens in (1, 0, 1):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=max_tokens,
                                      echo=True, logprobs=1, temperature=0)
        c = r.choices[0]
        assert c.text.startswith(PROMPT) and (max_tokens or c.text == PROMPT)
        lp = c.logprobs
        assert len(lp.tokens) == len(prompt_ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = lp.token_logprobs[1:len(prompt_ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < TOL
        assert lp.tokens[:len(prompt_ids)] == texts_of(prompt_ids)
        assert r.usage.prompt_tokens == len(prompt_ids)
        assert r.usage.completion_tokens == max_tokens
    # echo without logprobs: the prompt's text, then the completion; no logprobs.
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=3, echo=True,
                                  temperature=0, extra_body=IGNORE_EOS)
    plain = client.completions.create(model=name, prompt=PROMPT, max_tokens=3,
                                      temperature=0, extra_body=IGNORE_EOS)
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    assert r.choices[0].logprobs is None
    # Streamed: the prompt (and its logprobs) comes first.
    chunks = list(client.completions.create(model=name, prompt=PROMPT, max_tokens=0,
                                            echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    streamed = [x for c in chunks if c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and max(abs(a - b) for a, b in zip(streamed[1:], want)) < TOL


def test_n_and_prompt_lists_equal_single_requests(client, name):
    prompts = ["Once upon a time", "In a hole in the ground", "It was a dark night"]
    sampled = {"temperature": 2.0, "max_tokens": 8, "extra_body": IGNORE_EOS}
    r = client.completions.create(model=name, prompt=prompts, n=2, seed=11, **sampled)
    assert [c.index for c in r.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        for j in range(2):  # vLLM's rule: child j of a seeded request has seed + j
            alone = client.completions.create(model=name, prompt=prompt, seed=11 + j,
                                              **sampled)
            assert r.choices[i * 2 + j].text == alone.choices[0].text, (i, j)
    assert len({c.text for c in r.choices}) > 3  # the comparison above can fail
    again = client.completions.create(model=name, prompt=prompts, n=2, seed=11, **sampled)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    num_prompt = sum(len(tokenize_url(client, p)) for p in prompts)
    assert r.usage.prompt_tokens == num_prompt and r.usage.completion_tokens == 6 * 8
    # Token-id prompts, greedy: each choice equals its prompt asked alone.
    id_prompts = [[5, 6, 7, 8], [100, 200, 300]]
    r = client.completions.create(model=name, prompt=id_prompts, max_tokens=6, temperature=0,
                                  logprobs=1, extra_body=IGNORE_EOS)
    for i, p in enumerate(id_prompts):
        alone = client.completions.create(model=name, prompt=p, max_tokens=6, temperature=0,
                                          logprobs=1, extra_body=IGNORE_EOS)
        assert r.choices[i].text == alone.choices[0].text
        got, want = r.choices[i].logprobs.token_logprobs, alone.choices[0].logprobs.token_logprobs
        assert len(got) == 6 and max(abs(a - b) for a, b in zip(got, want)) < TOL  # batching


def test_streamed_choices_carry_their_index(client, name):
    prompts = ["Once upon a time", "It was a dark night"]
    kw = {"model": name, "prompt": prompts, "n": 2, "seed": 3, "temperature": 2.0,
          "max_tokens": 6, "logprobs": 1, "extra_body": IGNORE_EOS}
    full = client.completions.create(**kw)
    texts, finished, lps = {}, {}, {}
    stream = client.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finished == {i: "length" for i in range(4)}
    for c in full.choices:  # (equal up to the float rounding of another batch's shape)
        assert len(lps[c.index]) == 6
        assert max(abs(a - b) for a, b in zip(lps[c.index], c.logprobs.token_logprobs)) < TOL
    assert usage.completion_tokens == full.usage.completion_tokens == 24
    # Chat: each index gets its role chunk, its content and its finish.
    chunks = list(client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=4,
        temperature=0, stream=True, extra_body=IGNORE_EOS))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role]
    ends = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(roles) == sorted(ends) == [0, 1, 2]
    content = {}
    for c in chunks:
        content[c.choices[0].index] = content.get(c.choices[0].index, "") + \
            (c.choices[0].delta.content or "")
    assert len(set(content.values())) == 1  # greedy: three equal answers


@pytest.mark.parametrize("path, extra, param, words", [
    ("completions", {"logprobs": 21}, "logprobs", "[0, 20]"),
    ("completions", {"logprobs": -1}, "logprobs", "[0, 20]"),
    ("completions", {"logprobs": True}, "logprobs", "integer"),
    ("completions", {"echo": "yes"}, "echo", "boolean"),
    ("completions", {"n": 0}, "n", "[1, 64]"),
    ("completions", {"n": 65}, "n", "[1, 64]"),
    ("completions", {"n": 2.5}, "n", "integer"),
    ("completions", {"n": 33, "prompt": ["a", "b"]}, "n", "at most 64"),
    ("completions", {"n": 2, "seed": 2**63 - 1}, "seed", "2^63"),
    ("completions", {"max_tokens": 0}, "max_tokens", ">= 1"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
    ("completions", {"echo": True, "logprobs": 20, "prompt": [5] * 30000}, "logprobs",
     "fewer logprobs"),
    ("chat/completions", {"logprobs": 1}, "logprobs", "boolean"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "logprobs set to true"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("chat/completions", {"echo": True}, "echo", "not supported"),
])
def test_bad_values_are_400_naming_the_field(cluster, name, client, path, extra, param, words):
    base = {"model": name, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "Hi"}]} if path.startswith("chat")
                else {"prompt": "Hi"})
    r = httpx.post(f"{cluster.http_url}/v1/{path}", json={**base, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    # ... and the server goes on serving.
    assert client.completions.create(model=name, prompt="Hi", max_tokens=1).choices


def test_logprobs_survive_decode_node_sigkill(model_dir, hf, tmp_path):
    """A seeded sampled request with logprobs: its decode node dies mid-stream, the request
    moves, and every token's logprob (first from a prefill node, later from either decode
    node) still equals transformers'."""
    h = Harness(model_dir, tmp_path)
    try:
        h.start_nodes([("prefill", "lp"), ("decode", "ld0"), ("decode", "ld1")])
        prompt = [5, 9, 14, 3, 7, 21, 40]
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=77, ignore_eos=True,
                                logprobs=2)

        async def go():
            stream = h.core.submit(S.GenerationRequest(prompt, params))
            flight = h.core.requests[stream.request_id]
            tokens, lps, killed, moved_to = [], [], None, None
            async for ev in stream:
                tokens += ev.token_ids
                if ev.logprobs is not None:
                    lps += ev.logprobs.token_logprobs
                if killed is None and len(tokens) >= 2:
                    # Killed at its first token: killed later, a fast node could have sent
                    # all 40 before it died, and the request would never need to move.
                    killed = flight.decode_node
                    _kill(h.procs[killed])
                elif killed is not None and flight.decode_node not in (None, killed):
                    moved_to = flight.decode_node
            return tokens, lps, killed, moved_to

        tokens, lps, killed, moved_to = h.run(go())
        assert killed is not None and moved_to is not None and moved_to != killed, \
            "the request did not move off its killed decode node"
        assert len(h.core.registry.live("decode")) == 1, "no decode node was killed"
        assert len(tokens) == len(lps) == 40
        ref = hf_logprobs(hf, prompt + tokens)
        want = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(tokens)]
        assert max(abs(a - b) for a, b in zip(lps, want)) < TOL
        assert all(math.isfinite(x) for x in lps)
    finally:
        h.close()


def test_offline_llm_logprobs(model_dir, hf):
    from pdserve import LLM

    llm = LLM(dtype="float32", model=model_dir, max_num_batched_tokens=16)  # the prompt in 3 chunks
    prompt = list(range(3, 43))
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=2,
                                                prompt_logprobs=1, ignore_eos=True))[0]
    ref = hf_logprobs(hf, prompt + out.token_ids)
    want = [ref[i - 1, t].item() for i, t in enumerate(prompt + out.token_ids) if i]
    got = out.prompt_logprobs.token_logprobs + out.logprobs.token_logprobs
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < TOL
    assert all(len(t) == 2 for t in out.logprobs.top_ids)
    assert json.dumps(got)  # plain floats


def test_queue_ingress_logprobs(cluster, client, name):
    """The queue ingress: submit's logprobs k -> each tokens message carries its tokens'
    logprobs, equal to the HTTP API's; a bad k is refused naming the field."""
    import msgpack
    import zmq

    prompt = [5, 17, 300, 42, 9, 77]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.ingress)
    try:
        sock.send(msgpack.packb({"type": "submit", "id": "q1", "prompt_token_ids": prompt,
                                 "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                 "logprobs": 2}))
        sock.send(msgpack.packb({"type": "submit", "id": "q2", "prompt_token_ids": prompt,
                                 "max_tokens": 5, "logprobs": 21}))
        ids, lps, tops, ends = [], [], [], {}
        while len(ends) < 2:
            assert sock.poll(60_000), "no answer from the ingress"
            msg = msgpack.unpackb(sock.recv())
            if msg["type"] == "tokens":
                ids += msg["token_ids"]
                lps += msg["logprobs"]["token_logprobs"]
                tops += msg["logprobs"]["top_ids"]
            else:
                ends[msg["id"]] = msg
    finally:
        sock.close()
        ctx.term()
    assert ends["q1"]["type"] == "done" and len(ids) == len(lps) == 5
    assert all(len(t) == 2 and t[0] == i for t, i in zip(tops, ids))  # greedy: the best
    assert ends["q2"]["type"] == "error" and "logprobs" in ends["q2"]["message"]
    r = client.completions.create(model=name, prompt=prompt, max_tokens=5, temperature=0,
                                  logprobs=2, extra_body=IGNORE_EOS)
    assert max(abs(a - b) for a, b in zip(lps, r.choices[0].logprobs.token_logprobs)) < TOL


def test_n_choices_share_one_prefill(cluster, client, name):
    """n = 4 of a 1000-token prompt: the prefill node computes the prompt once; the three
    siblings, which reach it while the first is being prefilled, wait for its 62 full
    blocks and take them from the prefix cache (3 x 992 tokens hit; without the wait
    they would compute them again beside it)."""
    from tests.e2e.test_metrics import eventually, scrape, value

    url = cluster.metrics_urls()["prefill-0"]
    hits = "pdserve_prefix_cache_hits_tokens_total"
    before = value(scrape(url)[1], hits)
    prompt = [(13 * i + 5) % 997 + 3 for i in range(1000)]   # asked nowhere else
    r = client.completions.create(model=name, prompt=prompt, n=4, max_tokens=3, seed=1,
                                  temperature=1.0, extra_body=IGNORE_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    eventually(lambda: _assert_equal(value(scrape(url)[1], hits) - before, 3 * 992))


def _assert_equal(a, b):
    assert a == b, (a, b)


def test_merged_events_keep_their_logprobs():
    """A reader that fell behind gets one event for several: their logprobs, in order."""
    from pdserve.common.protocol import Logprobs

    def lp(x):
        return Logprobs(token_logprobs=[x], top_ids=[[1]], top_logprobs=[[x]])

    first = S.StreamEvent([4], "a", logprobs=lp(-1.0), prompt_logprobs=lp(-3.0))
    merged = first.then(S.StreamEvent([5], "b", logprobs=lp(-2.0))).then(
        S.StreamEvent([], "", finish_reason="stop"))
    assert merged.token_ids == [4, 5] and merged.finish_reason == "stop"
    assert merged.logprobs.token_logprobs == [-1.0, -2.0]
    assert merged.prompt_logprobs.token_logprobs == [-3.0]
