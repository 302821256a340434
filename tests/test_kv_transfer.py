"""KV pages to pages: kv_chunk on one side, the wire encoding, KVReceiver.place on the other."""
import pytest
import torch

from pdserve.common import protocol as P
from pdserve.engine.kv_transfer import (
    InboundTransfer,
    KVReceiver,
    TransferState,
    block_runs,
    kv_chunk,
    layer_groups,
)

LAYOUT = P.KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
MODEL = P.ModelIdentity(name="m", config_hash="h")
NUM_BLOCKS = 40


def caches(fill: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    make = (lambda: torch.randn(shape, generator=gen)) if fill else \
        (lambda: torch.full(shape, -7.0))
    return [(make(), make()) for _ in range(LAYOUT.num_layers)]


def test_block_runs():
    assert block_runs(torch.tensor([5, 6, 7, 2, 9, 10])) == [(0, 5, 3), (3, 2, 1), (4, 9, 2)]
    assert block_runs(torch.tensor([], dtype=torch.int64)) == []


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
        chunk = kv_chunk("r", MODEL, LAYOUT, src, torch.tensor(src_ids), num_tokens, start, end,
                         checksums=True, last=last, first_token=1 if last else None)
        receiver.place(P.decode(P.encode(chunk)), transfer)  # through the wire format
    assert transfer.state is TransferState.DONE
    untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_ids))
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before):
        assert torch.equal(dk[dst_ids], sk[src_ids]) and torch.equal(dv[dst_ids], sv[src_ids])
        assert torch.equal(dk[untouched], bk[untouched])
        assert torch.equal(dv[untouched], bv[untouched])
