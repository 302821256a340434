"""Counting the torch operations a step dispatches: each costs a few microseconds of
Python and dispatch however small its tensor, which is where a batch-1 decode step's
time beyond its memory floor (bench/floor.py) goes."""
from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# The operations that read a weight matrix: F.linear's (addmm, mm), oneDNN's (its reordered
# weights, model/cpu_linear.py) and the int4 GEMM (model/quant.py)
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul",
                        "aten::linear", "mkldnn::_linear_pointwise",
                        "aten::_weight_int4pack_mm_for_cpu"})
# Operations that copy a tensor's value to the host: the step waits for them
HOST_SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"})


class OpCounter(TorchDispatchMode):
    """Counts every operation dispatched inside ``with OpCounter() as ops:`` by name
    ("aten::mul", "mkldnn::_linear_pointwise"), below autograd: views count, and an
    operation made of others (F.linear) counts as the ones it runs."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        self.views += func.is_view
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def split(self) -> dict[str, int]:
        """The count as matmuls (weights read), views (no data touched), host syncs and
        the other small operations."""
        matmul = sum(n for name, n in self.counts.items() if name in MATMUL_OPS)
        sync = sum(n for name, n in self.counts.items() if name in HOST_SYNC_OPS)
        return {"matmul": matmul, "view": self.views, "sync": sync,
                "other": self.total - matmul - self.views - sync}
