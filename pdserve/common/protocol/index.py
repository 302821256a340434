"""The prefix-index plane (router <-> node, on the control socket): a router asks a node
for every block key its prefix cache holds, and the node answers with them and the
number of its last KV-event batch they include.

Why a message and not vLLM's replay socket: the replay ring keeps the last
``buffer_steps`` batches, so a router that joins after a day of traffic cannot rebuild a
cache from it (vLLM has no initial sync), and only the node's compute loop, which owns
the allocator, can say which event number a snapshot matches. The control socket also
carries the node's authenticated identity (CURVE), which the event socket does not.
"""
from pdserve.common.limits import MAX_INDEX_BLOCKS, Int64, Text, UInt64, list_of
from pdserve.common.protocol.base import Message, _message


@_message
class IndexDumpRequest(Message, tag="index_dump_request", kw_only=True):
    """router -> node: send every block key of your prefix cache (IndexDump)."""
    reason: Text = ""   # why (joined, gap after batch N, ...): for the node's log


@_message
class IndexDump(Message, tag="index_dump", kw_only=True):
    """node -> the router that asked: its prefix cache's block keys, the most recently
    stored last (at most MAX_INDEX_BLOCKS of them), as of KV-event batch ``seq`` (-1: none
    published yet). Events after ``seq`` change it; those up to ``seq`` are in it."""
    seq: Int64
    block_hashes: list_of(UInt64, MAX_INDEX_BLOCKS)
    truncated: bool = False   # the cache held more than MAX_INDEX_BLOCKS keys
