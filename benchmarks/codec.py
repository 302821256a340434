"""Encode + decode of the hot messages: the hand-written codec of commit 0573a06 against
the msgspec one, side by side in one process.

    git worktree add /tmp/old-codec 0573a06
    PYTHONPATH=. python benchmarks/codec.py --old /tmp/old-codec

The old tree's ``pdserve`` package is imported under its own name with the current one's
modules set aside, then both are swapped back, so each codec runs with its own protocol
classes. Messages: a TokenBatch of 128 items (one token each, as a decode step sends), a
PrefillBatch of 16 requests (512-token prompts), a KVAck of 16 results, a Heartbeat with
stats. Each figure is the best of --repeat runs of --number encode+decode round trips
(bytes frames, as a socket gives them), in microseconds per message.
"""
import argparse
import importlib
import sys
import timeit


def load_old(root: str):
    """(codec, protocol) of the tree at ``root``, imported beside the current pdserve."""
    mine = {k: v for k, v in sys.modules.items() if k == "pdserve" or k.startswith("pdserve.")}
    for k in mine:
        del sys.modules[k]
    sys.path.insert(0, root)
    try:
        codec = importlib.import_module("pdserve.common.codec")
        protocol = importlib.import_module("pdserve.common.protocol")
    finally:
        sys.path.remove(root)
        for k in [k for k in sys.modules if k == "pdserve" or k.startswith("pdserve.")]:
            del sys.modules[k]
        sys.modules.update(mine)
    return codec, protocol


def messages(P) -> dict:
    """The hot messages, built with protocol module P (old or new: same names)."""
    spec = getattr(P, "SamplingSpec", None) or P.SamplingParams  # (its name up to version 6)
    spec = spec(max_tokens=128, temperature=0.7, top_p=0.95, top_k=50, seed=1234,
                stop_token_ids=[2], ignore_eos=False)
    stats = P.NodeStats(num_free_blocks=900, num_total_blocks=1024, num_running=64,
                        num_waiting=3, queued_prompt_tokens=4096)
    return {
        "TokenBatch x128": P.TokenBatch(items=[
            P.TokenItem(req_id=f"req-{i:06d}~0", token_ids=[1000 + i]) for i in range(128)]),
        "PrefillBatch x16": P.PrefillBatch(requests=[
            P.PrefillRequest(req_id=f"req-{i:06d}~0", prompt_token_ids=list(range(i, i + 512)),
                             sampling=spec, decode_node_id="decode-0",
                             kv_address="tcp://10.0.0.2:7000", timeout_s=30.0)
            for i in range(16)]),
        "KVAck x16": P.KVAck(results=[P.KVResult(req_id=f"req-{i:06d}~0", ok=True)
                                      for i in range(16)]),
        "Heartbeat": P.Heartbeat(node_id="decode-0", stats=stats),
    }


def time_codec(codec, msg, number: int, repeat: int) -> tuple[float, float, float, int]:
    """(encode, decode, round trip) in us per message, and the header's size."""
    frames = [bytes(f) for f in codec.encode(msg)]
    assert codec.decode(frames) == msg
    enc = min(timeit.repeat(lambda: codec.encode(msg), number=number, repeat=repeat))
    dec = min(timeit.repeat(lambda: codec.decode(frames), number=number, repeat=repeat))
    both = min(timeit.repeat(lambda: codec.decode([bytes(f) for f in codec.encode(msg)]),
                             number=number, repeat=repeat))
    scale = 1e6 / number
    return enc * scale, dec * scale, both * scale, len(frames[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", default="/tmp/old-codec", help="a checkout of commit 0573a06")
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    old_codec, old_p = load_old(args.old)
    from pdserve.common import codec as new_codec
    from pdserve.common import protocol as new_p
    assert old_p.PROTOCOL_VERSION != new_p.PROTOCOL_VERSION, "--old is not the old tree"
    print(f"{'message':18} {'codec':6} {'header B':>8} {'encode us':>10} {'decode us':>10} "
          f"{'enc+dec us':>11} {'old/new':>8}")
    for name, old_msg in messages(old_p).items():
        new_msg = messages(new_p)[name]
        old = time_codec(old_codec, old_msg, args.number, args.repeat)
        new = time_codec(new_codec, new_msg, args.number, args.repeat)
        for label, (enc, dec, both, size) in (("old", old), ("new", new)):
            ratio = f"{old[2] / new[2]:7.1f}x" if label == "new" else ""
            print(f"{name:18} {label:6} {size:8d} {enc:10.1f} {dec:10.1f} {both:11.1f} {ratio:>8}")


if __name__ == "__main__":
    main()
