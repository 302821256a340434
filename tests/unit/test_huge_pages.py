"""The packed weights a decode step streams, moved into one arena of 2 MiB pages
(engine/host_memory.py's into_huge_pages): same values, same tensor objects, in the order
given, and a model's step computes the same bits from them; switched off by
PDSERVE_HUGE_PAGES=0; a tensor it cannot move whole stays where it is, and the sentence
it returns for the log counts it."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.host_memory import HUGE_PAGE, into_huge_pages, thp_mode
from pdserve.engine.inputs import build_model_inputs
from pdserve.kernels import native
from pdserve.model.loader import load_model
from pdserve.model.quant import Int4Linear

THP = thp_mode() in ("always", "madvise")


def some_tensors():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=gen),
            torch.randn(1000, 7, generator=gen).half(),
            torch.randn(5 << 18, generator=gen)]      # 5 MiB of float32


def test_tensors_move_into_one_arena_with_their_values():
    tensors = some_tensors()
    before = [(t, t.clone(), t.data_ptr()) for t in tensors]
    said = into_huge_pages(tensors + [tensors[0]])   # listed twice: placed once
    if not THP:
        assert "in 4 KiB pages" in said
        pytest.skip(f"no transparent huge pages here ({thp_mode()}): {said}")
    ptrs = [t.data_ptr() for t in tensors]
    assert ptrs[0] % HUGE_PAGE == 0 and all(p % 64 == 0 for p in ptrs)
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < 8 << 20
    for t, (same, copy, old) in zip(tensors, before):
        assert t is same and t.data_ptr() != old and torch.equal(t, copy)
        assert t.is_contiguous() and t.shape == copy.shape and t.dtype == copy.dtype
    found = re.match(r"(\d+\.\d) MiB in one arena, (\d+\.\d) MiB of it in 2 MiB pages", said)
    assert found, said
    assert float(found.group(1)) == round(sum(t.nbytes for t in tensors) / 2**20, 1)
    assert float(found.group(2)) >= 2, said   # at least the whole 2 MiB pages inside it


REPO = Path(__file__).resolve().parents[2]
AFTER_THE_HEAP_GREW = """
import torch
from pdserve.engine.host_memory import into_huge_pages
for _ in range(3):   # a freed large block raises glibc's mmap threshold: the next come
    block = torch.empty(20 << 20, dtype=torch.uint8)   # from the heap, pages touched
    block.fill_(1)
    del block
print(into_huge_pages([torch.ones(3 << 20, dtype=torch.uint8), torch.ones(5 << 18)]))
"""


@pytest.mark.skipif(not THP, reason=f"no transparent huge pages here ({thp_mode()})")
def test_the_arena_is_in_huge_pages_after_the_heap_has_grown():
    """Once a large block has been freed, glibc serves blocks up to 32 MiB from its heap,
    whose pages are already 4 KiB ones (an arena of torch.empty's got none in 2 MiB pages
    here): the arena is a mapping of its own. In a fresh process, where the heap's history
    is this test's."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_HUGE_PAGES"}
    done = subprocess.run([sys.executable, "-c", AFTER_THE_HEAP_GREW], capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    said = done.stdout.strip()
    found = re.match(r"(\d+\.\d) MiB in one arena, (\d+\.\d) MiB of it in 2 MiB pages", said)
    assert found and float(found.group(2)) >= 2, said


def test_switched_off_it_moves_nothing(monkeypatch):
    monkeypatch.setenv("PDSERVE_HUGE_PAGES", "0")
    tensors = some_tensors()
    ptrs = [t.data_ptr() for t in tensors]
    assert into_huge_pages(tensors).endswith("in 4 KiB pages: PDSERVE_HUGE_PAGES=0")
    assert [t.data_ptr() for t in tensors] == ptrs


@pytest.mark.skipif(not THP, reason=f"no transparent huge pages here ({thp_mode()})")
def test_a_tensor_it_cannot_move_whole_stays_where_it_is_and_is_counted():
    whole, base = some_tensors()[0], torch.zeros(100, 8)
    views = [base[1:], base.t(), base.view(-1)[:50]]
    before = [(v.data_ptr(), v.clone()) for v in views]
    said = into_huge_pages([whole, *views])
    assert said.startswith("3.0 MiB in one arena") and said.endswith(
        "; 3 left in place (not a whole contiguous CPU storage)"), said
    assert whole.data_ptr() % HUGE_PAGE == 0
    for v, (ptr, copy) in zip(views, before):
        assert v.data_ptr() == ptr and torch.equal(v, copy)
    assert into_huge_pages(views[:1]) == \
        "0.0 MiB left in place: none is a whole contiguous CPU storage"
    assert into_huge_pages([]) == "none to place"


@pytest.mark.skipif(native.why_unavailable() is not None,
                    reason=f"native kernels: {native.why_unavailable()}")
def test_a_model_steps_to_the_same_bits_from_the_arena(tiny_model, tmp_path):
    gguf_files = pytest.importorskip("tests.gguf_files")
    path = gguf_files.write_gguf(tiny_model("llama"), tmp_path / "q4_1.gguf", "Q4_1")
    model = load_model(path, "bfloat16", quantization="auto")
    model.fuse_projections()
    assert model.native_step is not None
    streamed = model.streamed_weights()
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert all(any(m.packed is t for t in streamed) for m in int4)
    cfg = model.config
    caches = [(torch.zeros(8, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16),
               torch.zeros(8, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16))
              for _ in range(cfg.num_hidden_layers)]

    def greedy_step():
        with torch.inference_mode():
            prefill = build_model_inputs([list(range(3, 40))], [0], [[5, 2, 7]], [True], 16)
            model(prefill.input_ids, prefill.positions, prefill.meta, caches)
            step = build_model_inputs([[11]], [37], [[5, 2, 7]], [True], 16,
                                      native_decode=True)
            return model(step.input_ids, step.positions, step.meta, caches)

    want = greedy_step()
    said = model.place_streamed_weights(into_huge_pages)   # after a step: it rebinds
    got = greedy_step()
    assert torch.equal(got, want)
    if THP:
        ptrs = [t.data_ptr() for t in streamed]
        assert ptrs == sorted(ptrs) and ptrs[0] % HUGE_PAGE == 0, said
