"""Codec unit tests: every message round-trips, tensors decode zero-copy, and
anything malformed ends in a ProtocolError that says what was wrong."""
import ctypes
import random
import tracemalloc

import msgpack
import msgspec
import pytest
import torch
import xxhash

from pdserve.common import codec
from pdserve.common import errors as E
from pdserve.common import protocol as P

MODEL = P.ModelIdentity(name="tiny-llama", config_hash="abc123")
STATS = P.NodeStats(num_free_blocks=90, num_total_blocks=100, num_running=3, num_waiting=1,
                    queued_prompt_tokens=512)
SAMPLING = P.SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, top_k=40, seed=7,
                            stop_token_ids=[2], ignore_eos=False)


def layout(dtype="bfloat16", num_layers=2):
    return P.KVLayout(num_layers=num_layers, num_kv_heads=2, head_dim=8, dtype=dtype,
                      block_size=4)


def kv_chunk(dtype="bfloat16", num_tokens=7, checksums=False, **kw):
    lay = layout(dtype)
    torch_dtype = codec.TORCH_DTYPES[dtype]
    shape = (-(-num_tokens // lay.block_size), lay.block_size, lay.num_kv_heads, lay.head_dim)
    tensors = {}
    for layer in range(lay.num_layers):
        for kv in "kv":
            if torch_dtype.is_floating_point:
                t = torch.randn(shape).to(torch_dtype)
            else:
                t = torch.randint(0, 100, shape).to(torch_dtype)
            tensors[f"{kv}{layer}"] = t  # [num_blocks, block_size, kv_heads, head_dim]
    sums = [codec.checksum_of(t) for t in tensors.values()] if checksums else []
    part = dict(req_id="r1", num_tokens=num_tokens, first_token=42)
    part.update((k, kw.pop(k)) for k in list(kw) if k in part)
    fields = dict(model=MODEL, kv_layout=lay, layer_start=0, layer_end=lay.num_layers,
                  last=True, parts=[P.KVPart(**part)], checksums=sums, tensors=tensors)
    fields.update(kw)
    return P.KVChunk(**fields)


def prefill_batch(n=3):
    return P.PrefillBatch(requests=[
        P.PrefillRequest(req_id=f"r{i}", prompt_token_ids=list(range(i, i + 10)),
                         sampling=SAMPLING, decode_node_id="d0", kv_address="tcp://10.0.0.2:7000",
                         timeout_s=30.0) for i in range(n)])


def hello(**kw):
    fields = dict(node_id="p0", role="prefill", protocol_version=P.PROTOCOL_VERSION, model=MODEL,
                  kv_layout=layout(), capacity=STATS, kv_address=None, pid=1234)
    fields.update(kw)
    return P.Hello(**fields)


SAMPLES = [
    hello(), hello(role="decode", kv_address="tcp://127.0.0.1:7001"),
    P.Welcome(accepted=True, reason="", heartbeat_interval_s=1.0, liveness=3),
    P.Heartbeat(node_id="p0", stats=STATS), P.Heartbeat(node_id="router"),
    prefill_batch(),
    P.FirstTokens(items=[P.FirstToken(req_id="r0", token_id=5),
                         P.FirstToken(req_id="r1", token_id=2, finish_reason="stop")]),
    P.Reserve(items=[P.ReserveRequest(req_id="r0", prompt_token_ids=[1, 2, 3], sampling=SAMPLING,
                                      prefill_node_id="p0", lease_s=5.0)]),
    P.ReserveReply(items=[P.ReserveResult(req_id="r0", ok=False, reason="no free blocks",
                                          num_blocks=0)]),
    kv_chunk(), kv_chunk(last=False, first_token=None, checksums=True),
    P.KVAck(results=[P.KVResult(req_id="r0", ok=True),
                     P.KVResult(req_id="r1", ok=False, reason="no reservation")]),
    P.TokenBatch(items=[P.TokenItem(req_id="r0", token_ids=[7, 8]),
                        P.TokenItem(req_id="r1", token_ids=[], finish_reason="length")]),
    P.Abort(req_ids=["r0", "r1"], reason="client disconnected"),
    P.Error(req_id=None, code=E.BAD_MESSAGE, message="x"),
    P.Error(req_id="r0", code=E.TIMEOUT, message="deadline passed"),
    P.Drain(reason="shutdown"),
    P.Bye(node_id="p0", reason="shutdown"),
    P.IndexDumpRequest(reason="joined"),
    P.IndexDump(seq=41, block_hashes=[0, 2**64 - 1, 12345]),
    # streams that outlive their router (issue 31)
    P.Reserve(items=[P.ReserveRequest(
        req_id="r0", prompt_token_ids=[1, 2, 3], sampling=SAMPLING, prefill_node_id="p0",
        lease_s=5.0, origin=P.StreamOrigin(owner="70647100", client_id="job-1", num_prompt=2,
                                           sampling=SAMPLING))]),
    P.Release(req_ids=["r0~1"], reason="a refused resume"),
    P.Resume(req_id="req-1", owner="70647100", client_id="job-1", held=4),
    P.Resumed(req_id="req-1", ok=False, code="stream_not_found", reason="not here"),
    P.Resumed(req_id="req-1", ok=True, wire_id="r0~1", prompt_token_ids=[1, 2],
              sampling=SAMPLING, token_ids=[3, 4, 5], finish_reason="length", timeout_s=9.5),
]


def header_of(frames):
    """The header as plain data: [version, [tag, field, ...]]."""
    return msgpack.unpackb(frames[0])


def with_header(frames, header):
    return [msgpack.packb(header), *frames[1:]]


def at(cls, name, tagged=False):
    """Where field ``name`` of ``cls`` sits in its wire array (after the tag, if tagged)."""
    return cls.__struct_fields__.index(name) + (1 if tagged else 0)


def edit(frames, cls, name, value):
    """frames with top-level field ``name`` of message ``cls`` set to ``value``."""
    header = header_of(frames)
    header[1][at(cls, name, True)] = value
    return with_header(frames, header)


def expect_error(frames, code=E.BAD_MESSAGE, *fragments, expected=None):
    with pytest.raises(P.ProtocolError) as info:
        codec.decode(frames, expected)
    assert info.value.code == code, info.value
    for fragment in fragments:
        assert fragment in info.value.message, info.value.message
    return info.value


def test_samples_cover_every_message_type():
    assert {type(m).TAG for m in SAMPLES} == set(P.MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = codec.encode(msg)
    for copy in (False, True):  # views as encoded, and bytes as a socket would give
        got = codec.decode([bytes(f) for f in frames] if copy else frames)
        assert got == msg and type(got) is type(msg)
        for name, t in getattr(msg, "tensors", {}).items():
            assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t)


@pytest.mark.parametrize("dtype", list(P.DTYPES))
def test_tensor_round_trip_every_dtype(dtype):
    msg = kv_chunk(dtype, checksums=True)
    got = codec.decode([bytes(f) for f in codec.encode(msg)])
    assert list(got.tensors) == list(msg.tensors)
    for name, t in msg.tensors.items():
        assert torch.equal(got.tensors[name], t)
    assert [codec.checksum_of(t) for t in got.tensors.values()] == got.checksums


def test_encode_takes_views_and_decode_is_zero_copy():
    msg = kv_chunk("float16", num_tokens=64)
    frames = codec.encode(msg)
    assert frames[1].obj is not None and not isinstance(frames[1], bytes)
    assert torch.frombuffer(frames[1], dtype=torch.uint8).data_ptr() == msg.tensors["k0"].data_ptr()
    buffers = [bytearray(f) for f in frames]
    got = codec.decode(buffers)
    for buf, t in zip(buffers[1:], got.tensors.values()):
        start = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        assert start <= t.data_ptr() < start + len(buf)
    buffers[1][0] ^= 0xFF  # the decoded tensor *is* the frame
    assert not torch.equal(got.tensors["k0"], msg.tensors["k0"])


def test_unaligned_frame_is_copied_to_aligned_memory():
    # ZeroMQ packs small frames into its receive batch at any offset.
    t = torch.arange(6, dtype=torch.float32)
    meta, frame = codec.tensor_to_frame("x", t)
    unaligned = memoryview(bytearray(len(frame) + 1))[1:]
    unaligned[:] = frame
    got = codec.frame_to_tensor(meta, unaligned)
    assert got.data_ptr() % 4 == 0 and torch.equal(got, t)


def test_non_contiguous_tensor_is_made_contiguous():
    msg = kv_chunk("float32")
    t = msg.tensors["k0"]
    strided = t.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not strided.is_contiguous()
    tensors = dict(msg.tensors, k0=strided)
    got = codec.decode(codec.encode(msgspec.structs.replace(msg, tensors=tensors)))
    assert torch.equal(got.tensors["k0"], t)


def test_sampling_params_travel_as_they_are():
    """Every sampling field round-trips inside a PrefillRequest; the router's for_nodes()
    leaves the stop strings (its own concern) out and nothing else."""
    params = P.SamplingParams(max_tokens=9, temperature=0.5, top_p=0.8, top_k=-1, seed=3,
                              stop=["END"], stop_token_ids=[2, 7], seed_offset=4, logprobs=2,
                              prompt_logprobs=1, min_tokens=3, repetition_penalty=1.2,
                              presence_penalty=-0.5, frequency_penalty=0.25,
                              logit_bias={5: 250, 6: -1.5}, guide=["regex", "[ab]+"])
    assert (params.top_k, params.logit_bias, params.guide) == (0, {5: 100.0, 6: -1.5},
                                                              ("regex", "[ab]+"))
    sent = params.for_nodes()
    assert sent.stop == [] and params.stop == ["END"]
    assert msgspec.structs.replace(sent, stop=["END"]) == params
    msg = P.PrefillBatch(requests=[P.PrefillRequest(
        req_id="r", prompt_token_ids=[1, 2], sampling=sent, decode_node_id="d",
        kv_address="tcp://h:1", timeout_s=1.0)])
    assert codec.decode(codec.encode(msg)).requests[0].sampling == sent


def test_int_accepted_for_float_and_converted():
    got = codec.decode(codec.encode(P.Welcome(accepted=True, reason="", heartbeat_interval_s=2,
                                      liveness=3)))
    assert type(got.heartbeat_interval_s) is float


def test_checksum_of_tensor_and_frame_agree():
    t = torch.arange(10, dtype=torch.int64)
    assert codec.checksum_of(t) == xxhash.xxh3_64_intdigest(t.numpy().tobytes()) \
        == codec.checksum_of(t.numpy().tobytes())


def test_protocol_error_answers_as_error_message():
    err = expect_error([b"\xc1"], E.BAD_MESSAGE, "MessagePack")
    reply = codec.decode(codec.encode(err.to_message("r9")))
    assert reply == P.Error(req_id="r9", code=E.BAD_MESSAGE, message=err.message)


# ---------------------------------------------------------------- malformed input

def test_garbage_and_truncated_headers():
    expect_error([], E.BAD_MESSAGE, "empty message")
    expect_error([b"\x00\xff\xfe garbage"], E.BAD_MESSAGE, "not the array [version, message]")
    expect_error([codec.encode(hello())[0] + b"\xc1"], E.BAD_MESSAGE, "not valid MessagePack")
    expect_error([b"\xc1"], E.BAD_MESSAGE, "not valid MessagePack")
    good = codec.encode(hello())
    expect_error([good[0][:-5]], E.BAD_MESSAGE, "not valid MessagePack")
    expect_error([msgpack.packb({"v": P.PROTOCOL_VERSION})], E.BAD_MESSAGE,
                 "header is not the array [version, message]")
    expect_error([object()], E.BAD_MESSAGE, "not a buffer")


def test_version_mismatch_names_both_versions():
    frames = codec.encode(hello())
    other = P.PROTOCOL_VERSION + 1
    err = expect_error(with_header(frames, [other, header_of(frames)[1]]), E.VERSION_MISMATCH)
    assert f"version {other}" in err.message and f"version {P.PROTOCOL_VERSION}" in err.message
    # A version 4 peer's header is a map: it hears which version it should speak.
    err = expect_error([msgpack.packb({"v": 4, "t": "hello", "tensors": []})],
                       E.VERSION_MISMATCH)
    assert "version 4" in err.message and f"version {P.PROTOCOL_VERSION}" in err.message
    expect_error([msgpack.packb({"v": P.PROTOCOL_VERSION, "t": "hello"})], E.BAD_MESSAGE,
                 "not the array [version, message]")
    expect_error(with_header(frames, [None, header_of(frames)[1]]), E.BAD_MESSAGE,
                 "no protocol version")


def test_unknown_and_unexpected_types():
    frames = codec.encode(hello())
    body = header_of(frames)[1]
    expect_error(with_header(frames, [P.PROTOCOL_VERSION, ["teleport", *body[1:]]]),
                 E.UNKNOWN_TYPE, "'teleport'")
    expect_error(with_header(frames, [P.PROTOCOL_VERSION, [[1], *body[1:]]]), E.UNKNOWN_TYPE)
    expect_error(with_header(frames, [P.PROTOCOL_VERSION, []]), E.UNKNOWN_TYPE)
    expect_error(frames, E.UNEXPECTED_TYPE,
                 "unexpected message type Hello on this socket, expected one of Heartbeat, Bye",
                 expected=(P.Heartbeat, P.Bye))
    assert codec.decode(frames, expected=(P.Hello,)) == hello()


def test_missing_and_wrong_typed_fields():
    frames = codec.encode(hello())
    header = header_of(frames)
    header[1] = header[1][:at(P.Hello, "pid", True)]  # the array ends before pid
    expect_error(with_header(frames, header), E.BAD_MESSAGE, "Hello.pid: missing field")
    header = header_of(frames)
    header[1] = header[1][:at(P.Hello, "compute", True)]  # trailing defaults may be left out
    assert codec.decode(with_header(frames, header)) == hello()
    header = header_of(frames)
    header[1].append("a field of a later version")  # ignored, as new fields must be
    assert codec.decode(with_header(frames, header)) == hello()
    header = header_of(frames)
    header[1][at(P.Hello, "capacity", True)][at(P.NodeStats, "num_running")] = True
    expect_error(with_header(frames, header), E.BAD_MESSAGE,
                 "Hello.capacity.num_running: expected `int`, got `bool`")
    expect_error(edit(frames, P.Hello, "model", "tiny"), E.BAD_MESSAGE,
                 "Hello.model: expected `object`, got `str`")
    layout_map = header_of(frames)[1][at(P.Hello, "kv_layout", True)]
    del layout_map["dtype"]
    expect_error(edit(frames, P.Hello, "kv_layout", layout_map), E.BAD_MESSAGE,
                 "Hello.kv_layout: object missing required field `dtype`")


def test_wrong_typed_field_inside_a_list():
    frames = codec.encode(prefill_batch())
    requests = header_of(frames)[1][1]
    ids, sampling = at(P.PrefillRequest, "prompt_token_ids"), at(P.PrefillRequest, "sampling")
    requests[2][ids] = "1 2 3"
    expect_error(edit(frames, P.PrefillBatch, "requests", requests), E.BAD_MESSAGE,
                 "PrefillBatch.requests[2].prompt_token_ids: expected `array`, got `str`")
    requests = header_of(frames)[1][1]
    requests[1][ids][4] = 1.5
    expect_error(edit(frames, P.PrefillBatch, "requests", requests), E.BAD_MESSAGE,
                 "PrefillBatch.requests[1].prompt_token_ids[4]: expected `int`, got `float`")
    requests = header_of(frames)[1][1]
    requests[0][sampling][at(P.SamplingParams, "seed")] = "7"
    expect_error(edit(frames, P.PrefillBatch, "requests", requests), E.BAD_MESSAGE,
                 "PrefillBatch.requests[0].sampling.seed: expected `int | null`, got `str`")


def test_limits_in_the_schema():
    """Integers, strings and lists outside the schema's limits are refused while decoding,
    with the field named (msgspec checks them; the encoder does not)."""
    def refused(msg, *fragments, expected=None):
        return expect_error([bytes(f) for f in codec.encode(msg)], E.BAD_MESSAGE, *fragments,
                            expected=expected)

    def reserve(**sampling):
        """A Reserve whose sampling fields are set on the wire (SamplingParams itself refuses
        such values as it is built)."""
        frames = codec.encode(P.Reserve(items=[P.ReserveRequest(
            req_id="r", prompt_token_ids=[1], prefill_node_id="p", lease_s=1.0,
            sampling=SAMPLING)]))
        items = header_of(frames)[1][1]
        for name, value in sampling.items():
            items[0][at(P.ReserveRequest, "sampling")][at(P.SamplingParams, name)] = value
        return edit(frames, P.Reserve, "items", items)

    expect_error(reserve(seed=P.MAX_SEED), E.BAD_MESSAGE,
                 "Reserve.items[0].sampling.seed: expected `int` <= 9223372036854775807")
    expect_error(reserve(seed=-1), E.BAD_MESSAGE,
                 "Reserve.items[0].sampling.seed: expected `int` >= 0")
    expect_error(reserve(logprobs=P.MAX_LOGPROBS + 1), E.BAD_MESSAGE,
                 f"Reserve.items[0].sampling.logprobs: expected `int` <= {P.MAX_LOGPROBS}")
    # A rule across fields is not the decoder's: the message decodes, and the receiver's
    # check of that one request (validate) refuses it, so its batch-mates are served.
    (item,) = codec.decode(reserve(min_tokens=17)).items
    with pytest.raises(ValueError, match=r"min_tokens=17 is invalid: must be an integer in "
                       r"\[0, max_tokens=16\]"):
        item.sampling.validate()
    refused(P.ReserveReply(items=[P.ReserveResult(req_id="r", ok=True, reason="",
                                                  num_blocks=2**64 - 1)]),
            "ReserveReply.items[0].num_blocks: expected `int` <= 9223372036854775807")
    refused(P.TokenBatch(items=[P.TokenItem(req_id="r", token_ids=[2**63])]),
            "TokenBatch.items[0].token_ids[0]: expected `int` <= 9223372036854775807")
    refused(P.Heartbeat(node_id="n" * (P.MAX_ID_CHARS + 1)),
            f"Heartbeat.node_id: expected `str` of length <= {P.MAX_ID_CHARS}")
    chunk = kv_chunk()
    too_many = [P.KVPart(req_id=str(i), num_tokens=1) for i in range(P.MAX_KV_PARTS + 1)]
    frames = edit(codec.encode(chunk), P.KVChunk, "parts",
                  [[p.req_id, p.num_tokens, 0, None, []] for p in too_many])
    expect_error(frames, E.BAD_MESSAGE, f"KVChunk.parts: expected `array` of length <= "
                 f"{P.MAX_KV_PARTS}")
    refused(P.Welcome(accepted=True, reason="", heartbeat_interval_s="1", liveness=3),
            "Welcome.heartbeat_interval_s: expected `float`, got `str`")


def test_huge_counts_claim_nothing():
    """An array or string header claiming 2^32 - 1 entries in a few bytes is refused
    before anything is allocated: decoding never outgrows its input."""
    tracemalloc.start()
    try:
        # array32, str32, map32 headers, each claiming 2^32 - 1 entries (or bytes)
        for claim in (b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff"):
            # [version, ["token_batch", <claim>]]: TokenBatch.items claims 4 billion entries
            head = msgpack.packb([P.PROTOCOL_VERSION, [P.TokenBatch.TAG, None]])[:-1] + claim
            expect_error([head], E.BAD_MESSAGE, "truncated")
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_a_header_of_empty_lists_is_too_large():
    """An empty list is 1 byte on the wire and 56 in memory: a header made of them is
    refused (too_large) before decoding, however its lists are nested."""
    n = 1 << 16
    top = [[]] * n
    frames = codec.encode(P.TokenBatch(items=[P.TokenItem(
        req_id="r", token_ids=[], logprobs=P.Logprobs(token_logprobs=[], top_ids=top,
                                                      top_logprobs=[]))]))
    expect_error(frames, E.TOO_LARGE, "one map or array per")
    # A legitimate message of the same size passes: the bound is on containers per byte.
    big = P.TokenBatch(items=[P.TokenItem(req_id=f"req-{i}", token_ids=[1000 + i, 7])
                              for i in range(n // 8)])
    assert codec.decode(codec.encode(big)) == big


def test_encode_checks_the_cross_field_rules_and_sizes():
    """Field types are checked where they are decoded (a wrong type from a bug in this
    process reaches the peer and is answered); what the encoder checks is the rest."""
    expect_error([bytes(f) for f in codec.encode(hello(pid="1234"))], E.BAD_MESSAGE,
                 "Hello.pid: expected `int`, got `str`")
    with pytest.raises(P.ProtocolError, match="Hello.role"):
        codec.encode(hello(role="router"))
    with pytest.raises(P.ProtocolError, match="Hello.host_id"):
        codec.encode(hello(host_id="h" * (P.MAX_HOST_ID + 1)))
    with pytest.raises(P.ProtocolError, match="not a registered message type"):
        codec.encode(MODEL)
    with pytest.raises(P.ProtocolError, match="cannot pack"):
        codec.encode(P.Heartbeat(node_id="x", stats=P.NodeStats(
            num_free_blocks=2**70, num_total_blocks=0, num_running=0, num_waiting=0,
            queued_prompt_tokens=0)))


def test_tensor_meta_mismatches():
    frames = codec.encode(kv_chunk("bfloat16"))
    metas = header_of(frames)[1][at(P.KVChunk, "tensors", True)]

    def with_metas(change):
        copy = {name: [m[0], list(m[1]), m[2]] for name, m in metas.items()}
        change(copy)
        return edit(frames, P.KVChunk, "tensors", copy)

    expect_error(with_metas(lambda m: m["v0"].__setitem__(0, "float32")), E.BAD_MESSAGE,
                 "'v0'", "x float32 is 512 bytes, its frame 2 has 256")
    expect_error(with_metas(lambda m: m["v0"].__setitem__(0, "float64")), E.BAD_MESSAGE,
                 "KVChunk.tensors[...].dtype: invalid enum value 'float64'")
    expect_error(with_metas(lambda m: m["k0"][1].__setitem__(0, -1)), E.BAD_MESSAGE,
                 "KVChunk.tensors[...].shape[0]: expected `int` >= 0")
    expect_error(with_metas(lambda m: m["k0"].__setitem__(1, [2**62] * 4)), E.BAD_MESSAGE,
                 "'k0'", "over 2^63 bytes")  # claims, never allocates
    expect_error(with_metas(lambda m: m["k0"].__setitem__(1, [1] * 9)), E.BAD_MESSAGE,
                 "shape: expected `array` of length <= 8")
    expect_error(with_metas(lambda m: m["k0"].__setitem__(2, 2)), E.BAD_MESSAGE,
                 "frame indices [2, 2, 3, 4] are not 1..4")
    short = list(frames)
    short[2] = bytes(frames[2])[:-1]
    expect_error(short, E.BAD_MESSAGE, "'v0'", "frame 2 has 255")
    # Frames are matched by index, not by order: a sender may list them in any order.
    swapped = with_metas(lambda m: (m["k0"].__setitem__(2, 2), m["v0"].__setitem__(2, 1)))
    got = codec.decode([swapped[0], frames[2], frames[1], *frames[3:]])
    assert all(torch.equal(got.tensors[n], t) for n, t in kv_chunk_tensors(frames).items())


def kv_chunk_tensors(frames):
    return codec.decode(frames).tensors


def test_frame_count_must_match_tensor_count():
    frames = codec.encode(kv_chunk())
    expect_error(frames[:-1], E.BAD_MESSAGE, "declares 4 tensor frame(s) but 3 followed")
    expect_error([*frames, b"extra"], E.BAD_MESSAGE, "declares 4 tensor frame(s) but 5 followed")
    hello_frames = codec.encode(hello())
    expect_error([hello_frames[0], *frames[1:]], E.BAD_MESSAGE,
                 "Hello carries no tensors but 4 frame(s) followed")
    expect_error(edit(frames, P.KVChunk, "tensors", []), E.BAD_MESSAGE,
                 "KVChunk.tensors: expected `object`, got `array`")


def test_kv_chunk_must_match_its_layout():
    with pytest.raises(P.ProtocolError, match="expected \\['k0', 'v0', 'k1', 'v1'\\]"):
        codec.encode(kv_chunk(tensors={"k0": torch.zeros(2, 4, 2, 8, dtype=torch.bfloat16)}))
    with pytest.raises(P.ProtocolError, match="tensor 'k0' is \\[2, 4, 2, 8\\] torch.float32"):
        codec.encode(kv_chunk(tensors=dict(kv_chunk().tensors, k0=torch.zeros(2, 4, 2, 8))))
    with pytest.raises(P.ProtocolError, match="not last"):
        codec.encode(kv_chunk(last=False))
    with pytest.raises(P.ProtocolError, match="layers \\[1, 3\\)"):
        codec.encode(kv_chunk(layer_start=1, layer_end=3))
    frames = codec.encode(kv_chunk())
    lay = header_of(frames)[1][at(P.KVChunk, "kv_layout", True)]
    lay["num_kv_heads"] = 4  # the peer's layout disagrees with its tensors
    expect_error(edit(frames, P.KVChunk, "kv_layout", lay), E.BAD_MESSAGE, "expected [2, 4, 4, 8]")
    expect_error(edit(frames, P.KVChunk, "checksums", [1, 2]), E.BAD_MESSAGE,
                 "2 checksums for 4 tensors")


def test_kv_chunk_parts_must_add_up():
    """Several requests' pages in one chunk: the frames hold exactly the parts' blocks, one
    after the other; ids are unique; one checksum per tensor or none."""
    a, b = P.KVPart(req_id="a", num_tokens=5), P.KVPart(req_id="b", num_tokens=3)
    tensors = {name: torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16) for name in
               P.kv_tensor_names(0, 2)}  # 2 blocks of a, 1 of b
    msg = kv_chunk(parts=[a, b], tensors=tensors)
    assert codec.decode(codec.encode(msg)).parts == [a, b]
    with pytest.raises(P.ProtocolError, match="expected \\[4, 4, 2, 8\\]"):
        codec.encode(kv_chunk(parts=[a, b, P.KVPart(req_id="c", num_tokens=1)],
                              tensors=tensors))
    with pytest.raises(P.ProtocolError, match="a request id appears in two parts"):
        codec.encode(kv_chunk(parts=[a, a], tensors=dict(tensors, **{
            n: torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16) for n in tensors})))
    with pytest.raises(P.ProtocolError, match="0 parts, expected 1 to 4096"):
        codec.encode(kv_chunk(parts=[]))
    with pytest.raises(P.ProtocolError, match="3 checksums for 4 tensors"):
        codec.encode(msgspec.structs.replace(msg, checksums=[1, 2, 3]))


def test_encode_rejects_unsupported_tensors():
    with pytest.raises(P.ProtocolError, match="float64"):
        codec.tensor_to_frame("x", torch.zeros(3, dtype=torch.float64))
    with pytest.raises(P.ProtocolError, match="expected torch.Tensor"):
        codec.tensor_to_frame("x", [1, 2])


def test_header_size_limit(monkeypatch):
    frames = codec.encode(prefill_batch(50))
    monkeypatch.setattr(codec, "MAX_HEADER_BYTES", 1000)  # the limit the codec enforces
    expect_error(frames, E.TOO_LARGE, "MAX_HEADER_BYTES=1000")
    with pytest.raises(P.ProtocolError, match="send fewer items"):
        codec.encode(prefill_batch(50))


def test_only_protocol_error_escapes_random_input():
    rng = random.Random(1234)
    valid = [codec.encode(m) for m in SAMPLES]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(500):
        kind = rng.randrange(4)
        if kind == 0:  # pure noise
            frames = [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
        elif kind == 1:  # a valid message with flipped bytes in the header
            frames = [bytes(f) for f in rng.choice(valid)]
            header = bytearray(frames[0])
            for _ in range(rng.randrange(1, 6)):
                header[rng.randrange(len(header))] = rng.randrange(256)
            frames[0] = bytes(header)
        elif kind == 2:  # a valid message cut short, frames dropped or added
            frames = [bytes(f) for f in rng.choice(valid)]
            frames[0] = frames[0][:rng.randrange(len(frames[0]) + 1)]
            if rng.random() < 0.5:
                frames = frames[:rng.randrange(len(frames) + 1)] + [b"x"] * rng.randrange(2)
        else:  # well-formed msgpack of random shape
            v = P.PROTOCOL_VERSION
            value = rng.choice([None, 1, -1, 2**63, "hello", b"\x00", [1, "x"], {"v": 1},
                                [v, [rng.choice(list(P.MESSAGE_TYPES))]], [v, []], [v, {}],
                                [v, ["kv_chunk", {}, {}, 0, 1, True, [], None, {"k0": 1}]]])
            frames = [msgpack.packb(value)] + [b"\x00" * rng.randrange(4)] * rng.randrange(2)
        try:
            codec.decode(frames)
            outcomes["ok"] += 1
        except P.ProtocolError as e:
            assert e.code in E.WIRE_CODES and e.message
            outcomes["error"] += 1
    assert outcomes["error"] > 400
