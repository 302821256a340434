"""`pdserve launch --dtype bfloat16` on a Q4_1 GGUF file: both nodes keep the projections
int4 (--quantization auto), say so in their start-up log, are admitted with their int4
identity, and the prefill node's KV decodes on the decode node."""
import httpx
import pytest

from tests.cluster import launched

gguf_files = pytest.importorskip("tests.gguf_files")


def test_a_1p1d_cluster_serves_int4_weights(tiny_model, tmp_path):
    model = gguf_files.write_gguf(tiny_model("llama"), tmp_path / "tiny-q4_1.gguf", "Q4_1")
    logs = tmp_path / "logs"
    logs.mkdir()
    with launched(model, 1, 1, "--dtype", "bfloat16", log_dir=logs) as cluster:
        r = httpx.post(cluster.http_url + "/v1/completions", timeout=60, json={
            "model": "tiny-q4_1", "prompt": "The quick brown fox", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    text = "\n".join(p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file())
    assert text.count("kept as int4 (Q4_1, bfloat16 scales)") == 2, text[-3000:]
