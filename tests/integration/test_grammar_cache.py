"""A node's compiled-guide cache is bounded in memory, not only in entries (issue 35):
distinct large schemas, each a few MB compiled, no longer pile up to 256 of them."""
from __future__ import annotations

from pathlib import Path

from pdserve.engine import grammar
from pdserve.engine.grammar import GrammarBackend
from pdserve.model.config import ModelConfig


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def wide_schema(tag: int, n: int = 990) -> str:
    props = ",".join(f'"p{tag}_{i}":{{"type":"string"}}' for i in range(n))
    return '{"type":"object","properties":{' + props + "}}"


def test_distinct_large_schemas_stay_within_the_cache_budget(tiny_model, monkeypatch):
    model = Path(tiny_model("llama"))
    cfg = ModelConfig.from_dir(model)
    backend = GrammarBackend(model, cfg.vocab_size, cfg.eos_token_ids)
    # about two such schemas
    monkeypatch.setattr(grammar, "CACHE_MAX_BYTES", 8 * 2**20, raising=False)
    for tag in range(2):
        backend.matcher(("json", wide_schema(tag)))
    before = rss_mb()
    for tag in range(2, 42):  # unbounded, 40 of these held about 150 MB more
        matcher = backend.matcher(("json", wide_schema(tag)))
        assert not matcher.is_error()
    grown = rss_mb() - before
    assert grown < 40, f"RSS grew {grown:.0f} MB over 40 compiled schemas"
    # What is kept still serves: the newest guide comes from the cache, as it was compiled.
    again = backend.matcher(("json", wide_schema(41)))
    assert again.consume_tokens([]) and not again.is_error()
