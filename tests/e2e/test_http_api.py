"""The OpenAI-compatible HTTP API.

Pure helpers (parsing, wire shapes) are tested directly; everything else runs
against a real cluster (`pdserve launch` via tests/cluster.py) with the
`openai` client, and greedy output is compared with the offline LLM.
"""
import asyncio
import json

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdserve.common.errors import REQUEST_TOO_LARGE
from pdserve.common.sampling import SamplingParams
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.http import api
from pdserve.router.streams import BAD_REQUEST, NOT_FOUND, RequestError

N = 12
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


def refused(fn, *args, **kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn(*args, **kw)
    return info.value


# -- pure helpers ---------------------------------------------------------------------------
def test_sampling_params_defaults_and_fields():
    p = api.sampling_params({}, 16)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == \
        (16, 1.0, 1.0, 0, None, [])
    p = api.sampling_params({"max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": -1,
                             "seed": 7, "stop": "\n", "stop_token_ids": [3],
                             "ignore_eos": True}, 16)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.stop_token_ids,
            p.ignore_eos) == (5, 0, 0.5, 0, 7, ["\n"], [3], True)
    # Chat: max_completion_tokens wins over the deprecated max_tokens.
    names = ("max_completion_tokens", "max_tokens")
    assert api.sampling_params({"max_tokens": 3, "max_completion_tokens": 4}, 9,
                               names).max_tokens == 4
    assert api.sampling_params({"max_tokens": 3}, 9, names).max_tokens == 3


@pytest.mark.parametrize("body, param, words", [
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": True}, "max_tokens", "integer"),
    ({"max_tokens": "8"}, "max_tokens", "integer"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"temperature": -1}, "temperature", "[0, 100]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_k": 1.5}, "top_k", "integer"),
    ({"seed": "x"}, "seed", "integer"),
    ({"stop": 3}, "stop", "string or an array of strings"),
    ({"stop": ["a", ""]}, "stop", "non-empty"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids", "integers"),
    ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
])
def test_sampling_params_refused(body, param, words):
    err = refused(api.sampling_params, body, 16)
    assert (err.code, err.param) == (BAD_REQUEST, param) and words in err.message


def test_unsupported_fields_refused_not_ignored():
    for chat in (False, True):
        api.refuse_unsupported({"n": 1, "best_of": None, "presence_penalty": 0.0,
                                "unknown_extra": 1, "user": "u"}, chat)
        err = refused(api.refuse_unsupported, {"best_of": 2}, chat)
        assert err.param == "best_of" and "best_of=2 is not supported" in err.message
    api.refuse_unsupported({"echo": False, "logprobs": None}, chat=False)
    api.refuse_unsupported({"logprobs": False, "tool_choice": "none", "echo": False,
                            "response_format": {"type": "text"}}, chat=True)
    for body, chat in (({"prompt_logprobs": 1}, False), ({"best_of": 3}, False),
                       ({"echo": True}, True), ({"functions": [{"name": "f"}]}, True),
                       ({"min_p": 0.5}, True)):
        assert refused(api.refuse_unsupported, body, chat).param == next(iter(body))


def test_model_and_stream_options():
    assert api.check_model({"model": "m"}, "m") == "m"
    err = refused(api.check_model, {"model": "gpt-4"}, "m")
    assert (err.code, err.http_status, err.param) == (NOT_FOUND, 404, "model")
    assert "'gpt-4'" in err.message and "'m'" in err.message
    assert refused(api.check_model, {}, "m").code == BAD_REQUEST
    assert api.stream_options({}) == (False, False)
    assert api.stream_options({"stream": True, "stream_options": {"include_usage": True}}) == \
        (True, True)
    assert refused(api.stream_options, {"stream_options": {"include_usage": True}}).param == \
        "stream_options"
    assert refused(api.stream_options, {"stream": "yes"}).param == "stream"


def test_completion_prompts(tokenizer):
    ids = tokenizer.encode("Hello world")
    assert ids[0] == tokenizer.token_to_id("<|begin_of_text|>")  # as the offline LLM encodes
    assert api.completion_prompt_ids(tokenizer, "Hello world") == ids
    assert api.completion_prompt_ids(tokenizer, ["Hello world"]) == ids
    assert api.completion_prompt_ids(tokenizer, [5, 6, 7]) == [5, 6, 7]
    assert api.completion_prompt_ids(tokenizer, [[5, 6, 7]]) == [5, 6, 7]
    assert api.completion_prompts(["a", [5, 6]]) == ["a", [5, 6]]
    assert api.completion_prompts([[5, 6]]) == [[5, 6]]
    err = refused(api.completion_prompts, ["a"] * 65)
    assert err.param == "prompt" and "at most 64" in err.message
    assert "required" in refused(api.completion_prompt_ids, tokenizer, None).message
    for prompt in (5, [1, "a"], {"text": "x"}, [True]):
        assert "must be a string" in refused(api.completion_prompt_ids, tokenizer, prompt).message


def test_chat_messages():
    msgs = api.chat_messages([{"role": "system", "content": "Be brief.", "name": "x"},
                              {"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}])
    assert msgs == [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "a\nb"}]
    for messages, param, words in (
            (None, "messages", "non-empty array"), ([], "messages", "non-empty array"),
            (["hi"], "messages[0]", "object"),
            ([{"role": "robot", "content": "x"}], "messages[0].role", "one of system"),
            ([{"role": "user"}], "messages[0].content", "string or an array"),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
             "messages[0].content", "only text content"),
            ([{"role": "assistant", "content": "", "tool_calls": [{}]}],
             "messages[0].tool_calls[0]", '"function": {"name", "arguments": JSON text}'),
            ([{"role": "user", "content": "x", "tool_calls": []}],
             "messages[0].tool_calls", "on an assistant message")):
        err = refused(api.chat_messages, messages)
        assert err.param == param and words in err.message, err.message


def test_chat_tokens_match_transformers(model_dir, tokenizer):
    """The template is rendered and encoded as apply_chat_template(tokenize=True) does:
    the bundled template has no BOS, and none is added."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if not isinstance(want, list) else want
    got = api.chat_prompt_ids(tokenizer, api.chat_messages(msgs))
    assert got == list(want)
    assert got[0] != tokenizer.token_to_id("<|begin_of_text|>")


def test_wire_shapes_parse_as_openai_types():
    reply = api.Reply(chat=False, id="cmpl-1", created=5, model="m")
    body = reply.full([reply.choice(0, "abc", "length")], 3, 4)
    c = Completion.model_validate(body)
    assert (c.object, c.choices[0].text, c.usage.total_tokens) == ("text_completion", "abc", 7)
    chunk = reply.chunk("x")
    assert "usage" not in chunk and chunk["choices"][0]["text"] == "x"

    reply = api.Reply(chat=True, id="chatcmpl-1", created=5, model="m", include_usage=True)
    c = ChatCompletion.model_validate(reply.full([reply.choice(0, "hi", "stop")], 3, 1))
    assert (c.object, c.choices[0].message.role, c.choices[0].message.content) == \
        ("chat.completion", "assistant", "hi")
    first, mid, last = reply.chunk(role=True), reply.chunk("yo"), reply.chunk(finish_reason="stop")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert mid["choices"][0]["delta"] == {"content": "yo"} and mid["usage"] is None
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    tail = reply.usage_chunk(3, 2)
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 5
    for obj in (first, mid, last, tail):
        assert ChatCompletionChunk.model_validate(obj).object == "chat.completion.chunk"
    assert api.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()


def test_error_bodies():
    body = api.error_body(RequestError(BAD_REQUEST, "max_tokens must be >= 1", "max_tokens"))
    assert body == {"error": {"message": "max_tokens must be >= 1", "type":
                              "invalid_request_error", "param": "max_tokens",
                              "code": "bad_request"}}
    assert RequestError(REQUEST_TOO_LARGE, "big").http_status == 413
    assert api.error_body(RequestError("internal", "x"))["error"]["type"] == "server_error"


# -- through a real cluster ---------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(model_dir):
    try:
        from tests.cluster import launched
    except ImportError:
        pytest.skip("tests/cluster.py (pdserve launch) is not there yet")
    with launched(model_dir) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir):
    from pdserve import LLM

    return LLM(dtype="float32", model=str(model_dir))


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def greedy(llm, prompt, n=N, **kw):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)
    return llm.generate([prompt], params)[0]


def hf_chat_ids(model_dir, messages):
    """Reference prompt ids, from transformers rather than our own helper."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_completions_greedy_equals_offline(client, model_name, llm, tokenizer):
    ref = greedy(llm, "The cluster of prefill")
    assert tokenizer.decode(ref.token_ids) == ref.text
    out = client.completions.create(model=model_name, prompt="The cluster of prefill",
                                    max_tokens=N, **GREEDY)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == \
        (len(ref.prompt_token_ids), N)
    ids = [7, 100, 200, 300]
    ref = greedy(llm, ids)
    out = client.completions.create(model=model_name, prompt=ids, max_tokens=N, **GREEDY)
    assert out.choices[0].text == ref.text and out.usage.prompt_tokens == len(ids)


def test_completions_stream_with_usage(client, model_name, llm):
    ref = greedy(llm, "Decode nodes stream")
    chunks = list(client.completions.create(
        model=model_name, prompt="Decode nodes stream", max_tokens=N, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_greedy_equals_offline(client, model_name, llm, model_dir):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ref = greedy(llm, hf_chat_ids(model_dir, msgs))
    out = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=N, **GREEDY)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == \
        (len(ref.prompt_token_ids), N)
    # Text parts give the same prompt as a plain string.
    parts = [msgs[0], {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    out = client.chat.completions.create(model=model_name, messages=parts,
                                         max_completion_tokens=N, **GREEDY)
    assert out.choices[0].message.content == ref.text


def test_chat_stream(client, model_name, llm, model_dir):
    msgs = [{"role": "user", "content": "Tell me about KV caches"}]
    ref = greedy(llm, hf_chat_ids(model_dir, msgs))
    chunks = list(client.chat.completions.create(
        model=model_name, messages=msgs, max_tokens=N, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + N


def test_chat_default_max_tokens_fills_the_context(client, model_name, model_dir, cluster):
    msgs = [{"role": "user", "content": "Go on"}]
    out = client.chat.completions.create(model=model_name, messages=msgs, **GREEDY)
    max_len = client.models.list().data[0].model_extra["max_model_len"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == max_len


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text(client, model_name, llm, stream):
    ref = greedy(llm, "Stop strings end", n=24)
    stop = ref.text[len(ref.text) // 2:][:3]
    want = ref.text[:ref.text.find(stop)]
    out = client.completions.create(model=model_name, prompt="Stop strings end", max_tokens=24,
                                    stop=[stop], stream=stream, **GREEDY)
    chunks = list(out) if stream else [out]
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def seeded(client, model_name):
    out = client.completions.create(model=model_name, prompt="Seeded", max_tokens=N,
                                    temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_seeded_sampling_is_reproducible(client, model_name):
    assert seeded(client, model_name) == seeded(client, model_name)


def test_seeded_sampling_equals_offline(client, model_name, llm):
    ref = llm.generate(["Seeded"], SamplingParams(temperature=1.0, max_tokens=N, seed=11,
                                                  ignore_eos=True))[0]
    assert seeded(client, model_name) == ref.text


def test_concurrent_requests_equal_offline(cluster, model_name, llm):
    prompts = ["One", "Two prompts", "Three prompts here", [9, 8, 7, 6, 5]]
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    refs = llm.generate(prompts, params)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=cluster.http_url + "/v1", api_key="none",
                                     max_retries=0, timeout=120)
        outs = await asyncio.gather(*(aclient.completions.create(
            model=model_name, prompt=p, max_tokens=N, **GREEDY) for p in prompts))
        await aclient.close()
        return outs

    outs = asyncio.run(run())
    assert [o.choices[0].text for o in outs] == [r.text for r in refs]


def test_models_and_health(cluster, model_name, model_dir):
    body = httpx.get(cluster.http_url + "/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["object"] == "model"
    assert body["data"][0]["id"] == model_name
    client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0)
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.get(cluster.http_url + "/health")
    assert (r.status_code, r.json()["status"]) == (200, "ok")
    assert set(r.json()["loops"]) == {"receive", "tick"}  # the router's loops, turning


def bad_requests(model_name):
    ok = {"model": model_name, "prompt": "Hi", "max_tokens": 2}
    chat = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}]}
    return [  # (path, raw body, status, param, words in the message)
        ("completions", b"{not json", 400, None, "not valid JSON"),
        ("completions", b"[1, 2]", 400, None, "JSON object"),
        ("completions", {**ok, "prompt": None}, 400, "prompt", "prompt is required"),
        ("completions", {"prompt": "Hi"}, 400, "model", "model is required"),
        ("completions", {**ok, "temperature": "hot"}, 400, "temperature", "number"),
        ("completions", {**ok, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
        ("completions", {**ok, "prompt": [5] * 5000}, 400, None, "context"),
        ("completions", {**ok, "model": "gpt-4"}, 404, "model", model_name),
        ("completions", {**ok, "best_of": 2}, 400, "best_of", "not supported"),
        ("completions", {**ok, "stream_options": {"include_usage": True}}, 400,
         "stream_options", "stream is true"),
        ("completions", {**ok, "prompt": "x" * (5 << 20)}, 413, None, "bytes"),
        ("chat/completions", {**chat, "messages": "Hi"}, 400, "messages", "array"),
        ("chat/completions", {**chat, "max_completion_tokens": -1}, 400,
         "max_completion_tokens", ">= 1"),
    ]


def test_bad_requests_get_clear_errors_and_server_keeps_serving(cluster, client, model_name):
    for path, body, status, param, words in bad_requests(model_name):
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(f"{cluster.http_url}/v1/{path}", content=content, timeout=60,
                       headers={"Content-Type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == status, (path, body if len(content) < 200 else param, r.text)
        assert set(err) == {"message", "type", "param", "code"}
        assert words in err["message"], err
        if param is not None:
            assert err["param"] == param, err
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    r = httpx.get(cluster.http_url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    for path in ("completions", "chat/completions"):  # POST alone takes the direct route
        r = httpx.get(f"{cluster.http_url}/v1/{path}")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    out = client.completions.create(model=model_name, prompt="Still here", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_client_disconnect_mid_stream_leaves_server_serving(cluster, client, model_name):
    body = {"model": model_name, "prompt": "Long", "max_tokens": 800, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", cluster.http_url + "/v1/completions", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    out = client.completions.create(model=model_name, prompt="After", max_tokens=3, **GREEDY)
    assert out.usage.completion_tokens == 3
    assert httpx.get(cluster.http_url + "/health").status_code == 200


def test_client_going_away_and_failures_mid_stream(model_dir):
    """Router in this process (to see core.cancel), nodes as real processes: a client that
    goes away cancels its request; a node dying mid-stream ends the SSE with an error."""
    import subprocess
    import sys

    import uvicorn

    from pdserve.router.config import RouterConfig
    from pdserve.router.core import RouterCore
    from tests.cluster import free_port

    async def until(cond, timeout_s):
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not cond():
            assert asyncio.get_running_loop().time() < deadline, "timed out"
            await asyncio.sleep(0.02)

    async def main():
        config = RouterConfig(model=str(model_dir), http_port=free_port(), ingress=None,
                              control=f"tcp://127.0.0.1:{free_port()}",
                              heartbeat_interval_s=0.5, liveness=2, request_timeout_s=5)
        core = RouterCore(config)
        cancelled, cancel = [], core.cancel
        core.cancel = lambda rid: (cancelled.append(rid), cancel(rid))
        await core.start()
        server = uvicorn.Server(uvicorn.Config(api.build_app(core), port=config.http_port,
                                               lifespan="off", log_level="warning"))
        serving = asyncio.create_task(server.serve())
        nodes = [await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdserve.cli", role, "--router", config.control, "--model",
            str(model_dir), "--threads", "1", "--heartbeat-interval", "0.5",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for role in ("prefill",
                                                                              "decode")]
        long = {"model": core.model_name, "prompt": "Long", "ignore_eos": True,
                "max_tokens": core.max_model_len - 8}
        try:
            await until(lambda: core.health()[0], 120)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.http_port}",
                                         timeout=60) as http:
                async with http.stream("POST", "/v1/completions",
                                       json={**long, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break
                await until(lambda: len(cancelled) == 1 and not core.flights, 10)
                with pytest.raises(httpx.ReadTimeout):
                    await http.post("/v1/completions", json=long, timeout=0.3)
                await until(lambda: len(cancelled) == 2 and not core.flights, 10)
                r = await http.post("/v1/completions", json={**long, "max_tokens": 2})
                assert r.json()["usage"]["completion_tokens"] == 2
                # A failure after the stream started: an SSE error chunk, then [DONE].
                async with http.stream("POST", "/v1/completions",
                                       json={**long, "stream": True}) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        if line and not lines:
                            nodes[1].kill()  # the decode node, after the first chunk
                        lines += [line] if line else []
                error = json.loads(lines[-2][len("data: "):])["error"]
                assert lines[-1] == "data: [DONE]" and error["type"] == "server_error"
                assert error["code"] in ("node_error", "no_nodes", "timeout") and error["message"]
                r = await http.get("/health")
                assert r.status_code == 503 and r.json()["status"] == "unavailable"
                assert "decode" in r.json()["reason"]
        finally:
            server.should_exit = True
            await serving
            for node in nodes:
                if node.returncode is None:
                    node.terminate()
                await node.wait()
            await core.stop()

    asyncio.run(main())


# -- vLLM's /tokenize, /detokenize and /version ---------------------------------------------
def test_tokenize_and_detokenize_agree_with_the_tokenizer(cluster, tokenizer, model_dir):
    text = "Serving systems batch requests"
    r = httpx.post(f"{cluster.http_url}/tokenize", json={"model": model_dir.name,
                                                          "prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0 and body["token_strs"] is None
    r = httpx.post(f"{cluster.http_url}/tokenize", timeout=30, json={
        "prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert "".join(r.json()["token_strs"]) == tokenizer.decode(r.json()["tokens"],
                                                              skip_special_tokens=False)
    messages = [{"role": "user", "content": "Hi there"}]
    r = httpx.post(f"{cluster.http_url}/tokenize", json={"messages": messages}, timeout=30)
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert r.json()["tokens"] == chat_ids
    r = httpx.post(f"{cluster.http_url}/detokenize", json={"tokens": body["tokens"]}, timeout=30)
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(body["tokens"])}
    r = httpx.get(f"{cluster.http_url}/version", timeout=30)
    from pdserve import __version__
    assert r.json() == {"version": __version__}


@pytest.mark.parametrize("path, body, fragment", [
    ("/tokenize", {}, "exactly one of 'prompt' and 'messages'"),
    ("/tokenize", {"prompt": "a", "messages": []}, "exactly one"),
    ("/tokenize", {"prompt": "a", "truncate": 3}, "unsupported field(s) ['truncate']"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "other"),
    ("/tokenize", {"prompt": [1, 2 ** 70]}, "outside [0,"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "must be a boolean"),
    ("/detokenize", {"tokens": []}, "non-empty list"),
    ("/detokenize", {"tokens": [1, -1, 2 ** 64]}, "outside [0,"),
    ("/detokenize", {"tokens": [1] * 100_000}, "at most"),
    ("/detokenize", {"tokens": [1.5]}, "outside [0,"),
])
def test_tokenizer_endpoints_refuse_bad_input_by_name(cluster, path, body, fragment):
    r = httpx.post(cluster.http_url + path, json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert fragment in r.json()["error"]["message"]
    assert httpx.get(cluster.http_url + "/health", timeout=30).status_code == 200


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(cluster, model_dir, tokenizer):
    """GET /tokenizer_info as vLLM serves it, read by lm-eval's own RemoteTokenizer
    (tokenizer_backend=remote): its special tokens, ids, text and chat template are the
    model's, as transformers gives them from the checkpoint folder."""
    import transformers
    from lm_eval.utils import RemoteTokenizer

    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    info = httpx.get(cluster.http_url + "/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] and info["model_max_length"] > 0
    remote = RemoteTokenizer(cluster.http_url + "/v1/completions")
    assert remote.eos_token == hf.eos_token and remote.bos_token == hf.bos_token
    assert remote.eos_token_id == hf.eos_token_id
    text = "The cluster of prefill and decode"
    assert remote.encode(text) == hf.encode(text, add_special_tokens=False)
    assert remote.decode(hf.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "user", "content": "Hello there"}]
    assert remote.apply_chat_template(messages) == \
        hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_a_stream_resume_over_http_is_a_clear_404(cluster):
    """The documented minimum for a client whose router died: any router answers where
    the client would resume, saying what it can do instead (docs/http-api.md)."""
    r = httpx.get(cluster.http_url + "/v1/streams/chatcmpl-123?from=4", timeout=30)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "stream_not_found" and "send the request again" in err["message"]
