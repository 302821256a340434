"""KV pages to pages: a backend's chunk on one side (tcp frames, shm references), the wire
encoding, KVReceiver.place on the other."""
import os
import subprocess
import sys

import msgspec
import pytest
import torch

from pdserve.common import codec
from pdserve.common import errors as E
from pdserve.common import protocol as P
from pdserve.engine.engine import layer_groups
from pdserve.node.kv import InboundTransfer, KVReceiver, KVTransferError, Outgoing, TransferState
from pdserve.node.kv.pages import paired_runs
from pdserve.node.kv.shm import ShmSource, shm_chunk
from pdserve.node.kv.tcp import frames_chunk

LAYOUT = P.KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
MODEL = P.ModelIdentity(name="m", config_hash="h")
NUM_BLOCKS = 40


def caches(fill: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    make = (lambda: torch.randn(shape, generator=gen)) if fill else \
        (lambda: torch.full(shape, -7.0))
    return [(make(), make()) for _ in range(LAYOUT.num_layers)]


def one(src, ids, num_tokens, start, end, *, last, segment=None, req_id="r"):
    """A chunk of one request's pages: tensor frames, or (with segment) shm references."""
    parts = [Outgoing(req_id, list(ids), num_tokens, first_token=1 if last else None)]
    if segment is None:
        return frames_chunk(MODEL, LAYOUT, src, parts, start, end, checksums=True, last=last)
    return shm_chunk(MODEL, LAYOUT, src, parts, start, end, checksums=True, last=last,
                     segment=segment)


def mapped(receiver):
    """The peer segments the receiver's shm source has mapped."""
    return receiver.source(ShmSource).segments


def place_one(receiver, chunk, transfer):
    """Places a one-request chunk; raises its failure."""
    failed = receiver.place(chunk, {0: transfer})
    if failed:
        raise failed[0]


def test_paired_runs():
    assert paired_runs([5, 6, 7, 2, 9, 10], [0, 1, 2, 3, 4, 6]) == [(5, 0, 3), (2, 3, 1),
                                                                   (9, 4, 1), (10, 6, 1)]
    assert paired_runs([], []) == []


@pytest.mark.parametrize("dst_ids", [
    list(range(10, 22)),                       # one run: one slice copy per layer
    [30, 31, 32, 33, 0, 1, 2, 3, 4, 17, 18, 19],  # three runs: slice copies
    [3, 9, 1, 27, 14, 5, 33, 20, 8, 11, 38, 2],   # scattered: index_copy_
])
@pytest.mark.parametrize("src_ids", [list(range(4, 16)), [7, 2, 30, 1, 8, 9, 22, 23, 5, 6,
                                                          39, 0]])
def test_pages_arrive_where_reserved(src_ids, dst_ids):
    src, dst = caches(fill=True), caches(fill=False)
    before = [(k.clone(), v.clone()) for k, v in dst]
    num_tokens = len(src_ids) * LAYOUT.block_size - 3
    transfer = InboundTransfer("r", torch.tensor(dst_ids), num_tokens)
    receiver = KVReceiver(MODEL, LAYOUT, dst)
    groups = layer_groups(LAYOUT.num_layers, 2)
    for start, end in groups:
        last = end == LAYOUT.num_layers
        chunk = one(src, src_ids, num_tokens, start, end, last=last)
        place_one(receiver, codec.decode(codec.encode(chunk)), transfer)  # through the wire
    assert transfer.state is TransferState.SUCCESS
    untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_ids))
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before):
        assert torch.equal(dk[dst_ids], sk[src_ids]) and torch.equal(dv[dst_ids], sv[src_ids])
        assert torch.equal(dk[untouched], bk[untouched])
        assert torch.equal(dv[untouched], bv[untouched])


def send_three(src_ids, transfers, corrupt_at=None):
    """Requests a, b, c's pages (3, 2 and 4 blocks of src_ids) in one chunk per layer group
    (one frame per tensor, one checksum each), placed by one receiver into blocks
    [20, 21, 5], [11, 2], [36..39]; ``corrupt_at``: the layer group whose v frame changes
    on the way. Returns the source and destination caches and the failures of the last
    group placed."""
    src, dst = caches(fill=True), caches(fill=False)
    spans = [src_ids[0:3], src_ids[3:5], src_ids[5:9]]
    tokens = [len(s) * LAYOUT.block_size - 1 for s in spans]
    receiver = KVReceiver(MODEL, LAYOUT, dst)
    for start, end in layer_groups(LAYOUT.num_layers, 2):
        last = end == LAYOUT.num_layers
        outgoing = [Outgoing(rid, span, n, first_token=7 if last else None)
                    for rid, span, n in zip("abc", spans, tokens)]
        frames = codec.encode(frames_chunk(MODEL, LAYOUT, src, outgoing, start, end,
                                           checksums=True, last=last))
        assert len(frames) == 1 + 2 * (end - start)  # one frame per tensor, all requests
        chunk = codec.decode([bytes(f) for f in frames])
        if start == corrupt_at:  # request c's second page of v changed on the way
            chunk.tensors[f"v{start}"][3 + 2 + 1, 0, 0, 0] += 1.0
        failed = receiver.place(chunk, {i: t for i, t in transfers.items()
                                        if t.state is not TransferState.FAILED})
        for t in (transfers[i] for i in failed):
            t.state = TransferState.FAILED
        if failed:
            return src, dst, spans, failed
    return src, dst, spans, {}


DSTS = [[20, 21, 5], [11, 2], [36, 37, 38, 39]]
TOKENS = [11, 7, 15]


@pytest.mark.parametrize("src_ids", [list(range(0, 9)), [30, 2, 17, 8, 9, 10, 0, 33, 5]])
def test_one_message_for_several_requests_places_each_where_reserved(src_ids):
    """Three requests' pages in one chunk: a and c land where reserved; b, with no transfer
    here (not reserved), is left out, its frame pages still covered by the checksums, and
    nobody else's blocks change."""
    transfers = {0: InboundTransfer("a", torch.tensor(DSTS[0]), TOKENS[0]),
                 2: InboundTransfer("c", torch.tensor(DSTS[2]), TOKENS[2])}
    before = caches(fill=False)
    src, dst, spans, failed = send_three(src_ids, transfers)
    assert failed == {}
    assert transfers[0].state is transfers[2].state is TransferState.SUCCESS
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before):
        for i in (0, 2):
            assert torch.equal(dk[DSTS[i]], sk[spans[i]]) and torch.equal(dv[DSTS[i]],
                                                                          sv[spans[i]])
        assert torch.equal(dk[DSTS[1]], bk[DSTS[1]]) and torch.equal(dv[DSTS[1]], bv[DSTS[1]])


@pytest.mark.parametrize("reserved", [(0, 2), (0, 1, 2)])
def test_a_corrupt_frame_fails_every_request_placed_from_it(reserved):
    """One checksum per frame: a page of c changed on the way fails a and c alike (with b
    left out, the frame is hashed whole before placing; with all three, while placing),
    naming the frame and the requests; the layers before it had landed."""
    transfers = {i: InboundTransfer("abc"[i], torch.tensor(DSTS[i]), TOKENS[i])
                 for i in reserved}
    src, dst, spans, failed = send_three(list(range(0, 9)), transfers, corrupt_at=2)
    assert sorted(failed) == list(reserved)
    for exc in failed.values():
        assert exc.code == E.CHECKSUM_MISMATCH
        assert "KV frame v2 of 3 request(s) ('a', 'b', 'c')" in exc.message
    for k in range(2):  # the layers before the corrupt one landed; the blocks are only freed
        assert torch.equal(dst[k][0][DSTS[2]], src[k][0][spans[2]])


# ---------------------------------------------------------------- same host, /dev/shm

@pytest.fixture
def segment_caches():
    """A sender's KV cache in a real /dev/shm segment, as a prefill node keeps it."""
    from pdserve.engine.model_runner import kv_tensor_bytes, kv_views
    from pdserve.node.kv.segment import Segment

    shape = (NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    seg = Segment.create(2 * LAYOUT.num_layers * kv_tensor_bytes(shape, torch.float32))
    views = kv_views(seg.data, LAYOUT.num_layers, shape, torch.float32)
    for (k, v), (sk, sv) in zip(views, caches(fill=True, seed=3)):
        k.copy_(sk)
        v.copy_(sv)
    yield seg, views
    seg.close()
    assert not os.path.exists(f"/dev/shm/{seg.name}")


def send_all(src, ids, receiver, transfer, segment, num_tokens, corrupt=None):
    for start, end in layer_groups(LAYOUT.num_layers, 2):
        last = end == LAYOUT.num_layers
        chunk = one(src, ids, num_tokens, start, end, last=last, segment=segment)
        if corrupt is not None:
            corrupt(start)
        place_one(receiver, codec.decode(codec.encode(chunk)), transfer)


@pytest.mark.parametrize("src_ids,dst_ids", [
    (list(range(4, 16)), list(range(10, 22))),
    ([7, 2, 30, 1, 8, 9, 22, 23, 5, 6, 39, 0], [3, 9, 1, 27, 14, 5, 33, 20, 8, 11, 38, 2]),
])
def test_shm_pages_arrive_where_reserved_same_as_tcp(segment_caches, src_ids, dst_ids):
    """Pages copied from the sender's segment (mapped a second time, read-only, as the
    decode node maps it) land exactly where the TCP frames land; the message has no frames."""
    seg, src = segment_caches
    num_tokens = len(src_ids) * LAYOUT.block_size - 3
    got = {}
    for path in ("shm", "tcp"):
        dst = caches(fill=False)
        receiver = KVReceiver(MODEL, LAYOUT, dst)
        transfer = InboundTransfer("r", torch.tensor(dst_ids), num_tokens)
        send_all(src, src_ids, receiver, transfer, seg if path == "shm" else None, num_tokens)
        assert transfer.state is TransferState.SUCCESS
        assert mapped(receiver).names == ([seg.name] if path == "shm" else [])
        receiver.close()
        got[path] = dst
    for (sk, sv), (dk, dv), (tk, tv) in zip(src, got["shm"], got["tcp"]):
        assert torch.equal(dk[dst_ids], sk[src_ids]) and torch.equal(dv[dst_ids], sv[src_ids])
        assert torch.equal(dk, tk) and torch.equal(dv, tv)


def test_corrupt_shm_region_is_caught_by_checksum(segment_caches):
    """A page changed in the segment after the sender hashed it (a bug reusing pages before
    the KVAck, another process writing) fails the transfer with checksum_mismatch."""
    seg, src = segment_caches
    src_ids, dst_ids = [5, 6, 7, 20], [0, 1, 2, 3]
    receiver = KVReceiver(MODEL, LAYOUT, caches(fill=False))
    transfer = InboundTransfer("r", torch.tensor(dst_ids), 4 * LAYOUT.block_size)

    def corrupt(start):
        if start == 2:
            src[2][1][20, 1, 0, 3] += 1.0  # v2, block 20: written behind the sender's back

    with pytest.raises(KVTransferError) as err:
        send_all(src, src_ids, receiver, transfer, seg, 4 * LAYOUT.block_size, corrupt)
    assert err.value.code == E.CHECKSUM_MISMATCH
    assert f"KV frame v2 (read from shared segment {seg.name})" in err.value.message
    receiver.close()


def test_shm_reference_outside_the_segment_is_refused(segment_caches):
    seg, src = segment_caches
    chunk = one(src, [1, 2], 8, 0, 1, last=False, segment=seg)
    chunk.shm.block_ids[1] = NUM_BLOCKS * 2 * LAYOUT.num_layers  # past the end
    receiver = KVReceiver(MODEL, LAYOUT, caches(fill=False))
    with pytest.raises(KVTransferError) as err:
        place_one(receiver, chunk, InboundTransfer("r", torch.tensor([0, 1]), 8))
    assert err.value.code == E.BAD_MESSAGE and "do not lie inside segment" in err.value.message
    chunk = msgspec.structs.replace(chunk, shm=msgspec.structs.replace(
        chunk.shm, segment="pdserve-kv-1-1-00000000"))  # no such segment
    with pytest.raises(KVTransferError) as err:
        place_one(receiver, chunk, InboundTransfer("r", torch.tensor([0, 1]), 8))
    assert "shared memory this node cannot read" in err.value.message
    receiver.close()


def test_checksum_without_gather_equals_checksum_of_gathered_pages():
    from pdserve.node.kv.pages import bytes_of, pages_checksum

    pool = caches(fill=True)[0][0]
    for ids in ([3, 4, 5], [9, 2, 3, 4, 31]):
        assert pages_checksum(bytes_of(pool), paired_runs(ids, ids), pool[0].nbytes) == \
            codec.checksum_of(pool[ids])


def test_segment_of_a_killed_process_is_swept():
    """SIGKILL leaves the owner no chance to unlink: the next sweep (every node runs one at
    start, decode nodes every few seconds) removes the file; a live owner's stays."""
    from pdserve.node.kv import segment as shm

    code = ("import sys, time; from pdserve.node.kv.segment import Segment; "
            "s = Segment.create(1 << 20); print(s.name, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert os.path.exists(f"/dev/shm/{name}")
        shm.sweep()
        assert os.path.exists(f"/dev/shm/{name}"), "the owner lives: its segment stays"
    finally:
        proc.kill()
        proc.wait()
    assert os.path.exists(f"/dev/shm/{name}")
    assert name in shm.sweep()
    assert not os.path.exists(f"/dev/shm/{name}")
