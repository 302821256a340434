"""min_tokens, repetition / presence / frequency penalties and logit_bias through the openai
client against `pdserve launch`, compared token for token with a greedy reference computed
here from transformers' logits and vLLM's definitions; they hold across prefill -> decode
(the first token is the prefill node's) and across a decode node killed mid-request.
stream_options.continuous_usage_stats puts the usage so far in every chunk."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch

from tests.cluster import launched
from tests.e2e.test_structured_output import decode_steps, kill_busy_decode_node

transformers = pytest.importorskip("transformers")
# A repeated prompt whose greedy continuation repeats tokens, so every penalty shows.
PROMPT = [867, 397, 779, 914, 433, 44] * 3


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with launched(model_dir, 1, 2, log_dir=tmp_path_factory.mktemp("launch")) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def reference(hf, prompt, n, repetition=1.0, presence=0.0, frequency=0.0, bias=None,
              min_tokens=0, stop_ids=()):
    """Greedy tokens under vLLM's definitions: min_tokens bans the stop tokens, logit_bias
    is added, repetition_penalty divides positive (multiplies negative) logits of tokens in
    prompt or output, frequency/presence subtract per output count / once."""
    ids, out = list(prompt), []
    vocab = hf.config.vocab_size
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            if len(out) < min_tokens:
                logits[list(stop_ids)] = float("-inf")
            for tok, b in (bias or {}).items():
                logits[tok] += b
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).float()
            seen = torch.bincount(torch.tensor(ids), minlength=vocab) > 0
            logits = torch.where(seen, torch.where(logits > 0, logits / repetition,
                                                   logits * repetition), logits)
            logits = logits - frequency * counts - presence * (counts > 0).float()
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
            if tok in stop_ids:
                break
    return out


def complete(client, n, **extra):
    r = client.completions.create(model="llama-0", prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body=extra)
    return r.choices[0]


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.6},
    {"presence_penalty": 2.0},
    {"frequency_penalty": 1.5},
    {"frequency_penalty": -1.0, "presence_penalty": 0.5, "repetition_penalty": 1.2},
])
def test_penalties_follow_vllm_definitions(cluster, client, hf, params):
    n = 24
    plain = reference(hf, PROMPT, n)
    want = reference(hf, PROMPT, n, repetition=params.get("repetition_penalty", 1.0),
                     presence=params.get("presence_penalty", 0.0),
                     frequency=params.get("frequency_penalty", 0.0))
    assert want != plain, "this penalty changes nothing here: the test would prove nothing"
    got = complete(client, n, ignore_eos=True, **params)
    assert same(cluster, got, want)


def same(cluster, choice, ids) -> bool:
    """Whether the choice's text is the text of ``ids`` (the stream holds back a trailing
    half UTF-8 character that /detokenize shows as U+FFFD)."""
    return choice.text.rstrip("\ufffd") == _decoded(cluster, ids).rstrip("\ufffd")


def _decoded(cluster, ids):
    return httpx.post(cluster.http_url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def test_logit_bias_adds_to_the_logits(cluster, client, hf):
    n = 16
    plain = reference(hf, PROMPT, n)
    bias = {plain[0]: -100.0, 42: 5.0, plain[3]: -3.0}
    want = reference(hf, PROMPT, n, bias=bias)
    assert want != plain
    got = complete(client, n, ignore_eos=True, logit_bias={str(k): v for k, v in bias.items()})
    assert same(cluster, got, want)
    forced = complete(client, 4, ignore_eos=True, logit_bias={"42": 1000})  # clamped to 100
    assert same(cluster, forced, [42] * 4)


def test_min_tokens_bans_stop_tokens_until_reached(cluster, client, hf):
    plain = reference(hf, PROMPT, 12)
    stop = [plain[2]]
    early = complete(client, 12, stop_token_ids=stop)
    assert early.finish_reason == "stop" and same(cluster, early, plain[:3])
    want = reference(hf, PROMPT, 12, min_tokens=8, stop_ids=stop)
    assert len(want) >= 8 and want != plain
    got = complete(client, 12, stop_token_ids=stop, min_tokens=8)
    assert same(cluster, got, want)


def test_continuous_usage_stats_in_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model="llama-0", messages=[{"role": "user", "content": "count"}], max_tokens=10,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 10
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == \
        chunks[-1].usage.prompt_tokens + 10
    plain = list(client.chat.completions.create(
        model="llama-0", messages=[{"role": "user", "content": "count"}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 4


@pytest.mark.parametrize("extra, param", [
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_tokens": 20}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"min_p": 0.1}, "min_p"),
    ({"bad_words": ["x"]}, "bad_words"),               # vLLM extensions not implemented
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
])
def test_out_of_range_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama-0", prompt="x", max_tokens=10, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body


def test_penalties_survive_a_decode_node_killed_mid_request(cluster, client):
    """The killed run equals an undisturbed one: the new nodes count the output of the
    earlier attempt (the end of the prompt they are sent) for the penalties."""
    extra = {"ignore_eos": True, "repetition_penalty": 1.3, "frequency_penalty": 0.4,
             "presence_penalty": 0.3, "logit_bias": {"42": 2.0}}
    want = complete(client, 900, **extra).text
    before, parts, killed = decode_steps(cluster), [], False
    stream = client.completions.create(model="llama-0", prompt=PROMPT, max_tokens=900,
                                       temperature=0, stream=True, extra_body=extra)
    for chunk in stream:
        parts.append(chunk.choices[0].text if chunk.choices else "")
        if len(parts) == 3 and not killed:
            kill_busy_decode_node(cluster, before)
            killed = True
        time.sleep(0.005)
    assert killed
    assert "".join(parts) == want
    assert "moves to other nodes" in cluster.log()


def test_stage_equals_the_dense_definition_and_is_free_when_unused():
    """Pure: the stage (gathering only the tokens seen) against vLLM's dense formula on a
    mixed batch; a batch no request processes gets its logits back untouched."""
    from pdserve.common.sampling import SamplingParams
    from pdserve.engine.logits_processors import LogitsProcessors
    from pdserve.engine.sequence import Sequence

    vocab, gen = 300, torch.Generator().manual_seed(0)
    stage = LogitsProcessors("unused", vocab, (1,))
    kinds = [{}, {"repetition_penalty": 1.7, "frequency_penalty": 0.7},
             {"presence_penalty": -1.0, "repetition_penalty": 0.5}, {"frequency_penalty": 2.0}]
    seqs = []
    for i, kw in enumerate(kinds):
        seq = Sequence(str(i), torch.randint(0, vocab, (40,), generator=gen).tolist(),
                       SamplingParams(max_tokens=50, **kw))
        seq.token_ids += torch.randint(0, 30, (i * 7,), generator=gen).tolist()  # repeats
        seqs.append(seq)
    logits = torch.randn(len(seqs), vocab, generator=gen) * 4
    got = stage.apply(logits, seqs)
    for row, seq in enumerate(seqs):
        p, want = seq.params, logits[row].clone()
        counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long),
                                minlength=vocab).float()
        seen = torch.bincount(torch.tensor(seq.token_ids), minlength=vocab) > 0
        want = torch.where(seen, torch.where(want > 0, want / p.repetition_penalty,
                                             want * p.repetition_penalty), want)
        want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(got[row], want)
    plain = [Sequence("p", [1, 2, 3], SamplingParams(max_tokens=5))]
    assert stage.apply(logits[:1], plain) is logits[:1] or \
        stage.apply(logits[:1], plain).data_ptr() == logits.data_ptr()
