"""copy_pages: every run lands where it is named, long runs in pieces, and the hash it
feeds equals the checksum of the same pages gathered in order."""
import random

import torch
import xxhash

from pdserve.common.codec import checksum_of
from pdserve.node.kv import pages as kv_pages
from pdserve.node.kv.pages import bytes_of, copy_pages, paired_runs


def test_copy_pages_places_every_run_and_hashes_in_order(monkeypatch):
    page_shape, num_pages = (4, 2, 8), 64                 # 256-byte float32 pages
    monkeypatch.setattr(kv_pages, "PIECE_BYTES", 3 * 256)  # runs over 3 pages go in pieces
    rng = random.Random(7)
    src = torch.randn(num_pages, *page_shape)
    dst = torch.zeros(num_pages, *page_shape)
    src_ids = list(range(10, 20)) + rng.sample(range(20, 64), 12) + [0, 1]  # a 10-page run
    dst_ids = list(range(30, 40)) + rng.sample(range(0, 30), 12) + [62, 63]
    runs = paired_runs(src_ids, dst_ids)
    assert max(n for _, _, n in runs) == 10
    h = xxhash.xxh3_64()
    copy_pages(bytes_of(dst), bytes_of(src), runs, src[0].nbytes, h)
    assert torch.equal(dst[dst_ids], src[src_ids])
    untouched = sorted(set(range(num_pages)) - set(dst_ids))
    assert not dst[untouched].any()
    assert h.intdigest() == checksum_of(src[src_ids].contiguous())
