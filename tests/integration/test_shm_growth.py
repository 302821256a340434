"""A prefill node's /dev/shm KV segment grows with use (node/kv/segment.py): real
segments in a small tmpfs mounted over /dev/shm in a mount namespace the test makes
(``unshare``), so that filling it up touches nothing outside. The child prints what it
saw as JSON; a SIGBUS would kill it (the return code says so)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

TMPFS_MIB = 40

CHILD = textwrap.dedent('''
    import json, logging, os, torch
    from pdserve.engine.block_allocator import BlockAllocator, RESERVE_STEP
    from pdserve.engine.host_memory import SparseStorage
    from pdserve.engine.model_runner import kv_storage_of, kv_tensor_bytes, kv_views
    from pdserve.node.kv.segment import Segment, SegmentError

    logging.basicConfig(level=logging.ERROR)
    LAYERS, SHAPE = 2, (1000, 16, 2, 64)      # 8 KiB a block and tensor, 31 MiB in all

    def shm_used():
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    out = {"step": RESERVE_STEP}
    nbytes = 2 * LAYERS * kv_tensor_bytes(SHAPE, torch.float32)
    seg = Segment.create(nbytes)
    out["created"] = shm_used()
    data, reserve = kv_storage_of(SparseStorage(seg.data, seg.reserve), LAYERS, SHAPE,
                                  torch.float32)
    views = kv_views(data, LAYERS, SHAPE, torch.float32)
    alloc = BlockAllocator(SHAPE[0], reserve=reserve)
    out["started"] = shm_used()
    held = alloc.allocate(RESERVE_STEP + 100)
    out["grown"] = shm_used()

    def write(blocks):
        for k, v in views:
            k[blocks] = 1.0
            v[blocks] = 2.0

    write(held)
    out["written"] = shm_used()
    reader = Segment.open(seg.name)  # as a decode node maps it
    before = rss()
    page = reader.data[:kv_tensor_bytes(SHAPE[1:], torch.float32)].view(torch.float32)
    out["read"] = float(page.sum())
    out["reader_rss"] = rss() - before
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with open("/dev/shm/filler", "wb") as f:  # another tenant fills /dev/shm up
        f.write(b"x" * (free - 1024 * 1024))
    out["exact"] = alloc.allocate(80)          # the step ahead does not fit, these do
    out["cap_ok"] = alloc.can_allocate(500)
    out["num_blocks"] = alloc.num_blocks
    write(held + out["exact"])                 # every block handed out is writable
    try:
        Segment.create(nbytes)
    except SegmentError as exc:
        out["refused"] = str(exc)
    print(json.dumps(out))
''')


ENGINE_CHILD = textwrap.dedent('''
    import json, logging, os, sys
    from pdserve.common.sampling import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.host_memory import SparseStorage
    from pdserve.node.kv.segment import Segment

    logging.basicConfig(level=logging.ERROR)

    def storage(nbytes):  # as a prefill node's shm sender makes it; then /dev/shm fills up
        seg = Segment.create(nbytes)
        st = os.statvfs("/dev/shm")
        with open("/dev/shm/filler", "wb") as f:
            f.write(b"x" * (st.f_bavail * st.f_frsize - 24 * 1024))
        return SparseStorage(seg.data, seg.reserve)

    engine = Engine(EngineConfig(model=sys.argv[1], dtype="float32", threads=1,
                                 num_kv_blocks=200, block_size=16), kv_storage=storage)
    greedy = dict(temperature=0, ignore_eos=True)
    engine.add_request("long", list(range(2, 902)), SamplingParams(max_tokens=50, **greedy))
    engine.add_request("short", [5, 6, 7, 8], SamplingParams(max_tokens=8, **greedy))
    tokens, rejected = {}, {}
    for _ in range(50):
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        rejected.update(engine.take_rejected())
        if not engine.has_unfinished():
            break
    print(json.dumps({"tokens": tokens, "rejected": rejected,
                      "num_blocks": engine.allocator.num_blocks,
                      "unfinished": engine.has_unfinished()}))
''')


def run_in_small_shm(tmp_path, child: str = CHILD, *args: str) -> dict:
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1) to make a mount namespace")
    script = tmp_path / "child.py"
    script.write_text(child)
    cmd = ["unshare", "-rm", "sh", "-c",
           f"mount -t tmpfs -o size={TMPFS_MIB}m tmpfs /dev/shm && "
           f"exec {sys.executable} {script} {' '.join(args)}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child exited {proc.returncode}: {proc.stderr[-3000:]}"
    return {"log": proc.stderr, **json.loads(proc.stdout.strip().splitlines()[-1])}


def test_segment_is_backed_as_blocks_are_used_and_stops_where_shm_is_full(tmp_path):
    out = run_in_small_shm(tmp_path)
    mib, step = 2**20, out["step"]
    block_bytes = 4 * 8192  # a block in each of 2 layers' K and V
    assert out["created"] < mib, "a new segment takes no /dev/shm memory"
    # backed: the first block and a step ahead; then what was taken and a step ahead
    assert out["started"] - out["created"] == pytest.approx((1 + step) * block_bytes,
                                                           abs=64 * 1024)
    assert out["grown"] - out["created"] == pytest.approx((2 * step + 100) * block_bytes,
                                                         abs=64 * 1024)
    assert out["written"] == out["grown"], "writes land in what was backed"
    assert out["read"] == 16 * 2 * 64 * 1.0  # the peer's mapping reads the pages written
    assert out["reader_rss"] < 4 * mib, "a reader maps the pages it reads, not all 31 MiB"
    assert out["exact"] == list(range(step + 100, step + 180))
    assert not out["cap_ok"] and out["num_blocks"] == step + 180
    assert f"the KV pool stops at {step + 180} blocks" in out["log"]
    assert out["refused"].startswith("cannot make a 31 MiB KV segment in /dev/shm: ")
    assert "MiB free there" in out["refused"]


def test_requests_that_no_longer_fit_a_pool_that_stopped_growing_fail_with_why(tmp_path,
                                                                            tiny_model):
    """/dev/shm fills up just after the segment is made: the pool stops at the blocks it
    backed. A request accepted for the whole pool is ended with no_capacity and the reason
    (not left waiting forever); one that fits is served."""
    out = run_in_small_shm(tmp_path, ENGINE_CHILD, str(tiny_model("llama")))
    assert not out["unfinished"]
    assert out["num_blocks"] < 57, "the pool stopped short of the long request's blocks"
    code, why = out["rejected"]["long"]
    assert code == "no_capacity"
    assert why == (f"needs up to 950 tokens of KV cache, but the cache stopped growing at "
                   f"{out['num_blocks'] * 16} (its memory could not be had)")
    assert len(out["tokens"]["short"]) == 8 and "long" not in out["tokens"]
    assert "the KV pool stops at" in out["log"]
