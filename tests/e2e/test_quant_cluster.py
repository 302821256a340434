"""`pdserve launch --dtype bfloat16` on a Q4_1 GGUF file: both nodes keep the projections
int4 (--quantization auto), say so in their start-up log, are admitted with their int4
identity, and the prefill node's KV decodes on the decode node."""
import pytest

from tests.cluster import q4_1_cluster_logs

pytest.importorskip("tests.gguf_files")


def test_a_1p1d_cluster_serves_int4_weights(tiny_model, tmp_path):
    text = q4_1_cluster_logs(tiny_model, tmp_path, "--dtype", "bfloat16")
    assert text.count("kept as int4 (Q4_1)") == 2, text[-3000:]
    assert text.count("int4 projections: ") == 2, text[-3000:]  # and which kernel runs them
    assert text.count("; prefill attention: ") == 2, text[-3000:]  # and which attention
