"""lm-evaluation-harness as a real client: its `local-completions` model scores two small
tasks defined here from local JSONL files (no download) against `pdserve launch`, and
the scores, sample by sample, equal those of its `hf` model on the same checkpoint in
float32: a multiple-choice task (loglikelihood: echo, max_tokens 1, logprobs 1, prompt
lists) and a generate_until task (greedy, stop strings)."""
from __future__ import annotations

import json

import pytest

from tests.cluster import launched

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    ("The sky is", ["blue", "green", "loud"], 0),
    ("Two plus two is", ["four", "five", "seven"], 0),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin"], 0),
    ("The opposite of hot is", ["cold", "warm", "spicy"], 0),
    ("A dog says", ["woof", "meow", "moo"], 0),
    ("The capital of France is", ["Paris", "Rome", "Berlin"], 0),
]
TOL = 1e-3


@pytest.fixture(scope="module")
def cluster(tiny_model):
    """One 1P1D cluster on the tiny Llama for both tests (lm-eval only reads from it),
    offline as the tests are: nothing of either reaches the Hugging Face hub."""
    with pytest.MonkeyPatch.context() as mp:
        offline(mp)
        with launched(tiny_model("llama"), 1, 1) as c:
            yield c


def offline(mp) -> None:
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_HUB_OFFLINE", "1")


def write_tasks(root) -> None:
    """Two tasks over one local JSONL: a multiple-choice (loglikelihood) one and a
    generate_until one."""
    data = root / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\ndoc_to_text: \"{{question}}\"\n")
    (root / "pd_mc.yaml").write_text(
        "task: pd_mc\noutput_type: multiple_choice\n" + common
        + "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (root / "pd_gen.yaml").write_text(
        "task: pd_gen\noutput_type: generate_until\n" + common
        + "doc_to_target: \"{{choices[answer]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 8\n"
        "  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")


def evaluate(model: str, model_args: dict, root) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # include_defaults=False: only the two tasks above. lm-eval's own ~26,000 task files,
    # which it otherwise parses on every TaskManager, took 12-15 s a call here.
    return simple_evaluate(model=model, model_args=model_args, tasks=["pd_mc", "pd_gen"],
                           task_manager=TaskManager(include_path=str(root),
                                                    include_defaults=False),
                           log_samples=True, bootstrap_iters=0)


def responses(results: dict, task: str) -> list:
    """Each sample's filtered responses, in document order."""
    return [s["filtered_resps"] for s in sorted(results["samples"][task],
                                                key=lambda s: s["doc_id"])]


def test_lm_eval_through_pdserve_equals_its_hf_model(tiny_model, cluster, tmp_path,
                                                     monkeypatch):
    offline(monkeypatch)
    model_dir = tiny_model("llama")
    write_tasks(tmp_path)
    hf = evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu",
                         "add_bos_token": True, "batch_size": 4}, tmp_path)
    served = evaluate("local-completions", {
        "model": model_dir.name, "base_url": f"{cluster.http_url}/v1/completions",
        "tokenizer": str(model_dir), "tokenizer_backend": "huggingface",
        "add_bos_token": True, "batch_size": 4, "max_retries": 1,
        "max_length": 512}, tmp_path)

    # Loglikelihood: every (document, choice) pair's score and greediness.
    got, want = responses(served, "pd_mc"), responses(hf, "pd_mc")
    assert len(got) == len(want) == len(QUESTIONS)
    for g_doc, w_doc in zip(got, want):
        assert len(g_doc) == len(w_doc) == 3
        for (g_ll, g_greedy), (w_ll, w_greedy) in zip(g_doc, w_doc):
            assert abs(float(g_ll) - float(w_ll)) < TOL and g_greedy == w_greedy
    # Greedy generations, cut at the same stop strings. A generation cut by max_gen_toks
    # inside a UTF-8 character: transformers decodes the partial bytes as U+FFFD, pdserve
    # (as vLLM) never sends half a character; the rest is equal.
    got, want = responses(served, "pd_gen"), responses(hf, "pd_gen")
    assert [[t.rstrip("\ufffd") for t in r] for r in want] == got
    assert sum(len(r[0]) for r in got) > 20  # (the tiny model writes something)
    for task, metric in (("pd_mc", "acc,none"), ("pd_gen", "exact_match,none")):
        assert served["results"][task][metric] == hf["results"][task][metric]


def test_lm_eval_with_only_what_pdserve_serves(tiny_model, cluster, tmp_path, monkeypatch):
    """tokenizer_backend=remote: lm-eval takes its tokenizer from the router's
    /tokenizer_info, /tokenize and /detokenize, no tokenizer folder given, and every
    sample's response equals the run with the checkpoint's own tokenizer. Without the
    endpoint lm-eval refuses to start (it asks for /tokenizer_info first)."""
    offline(monkeypatch)
    model_dir = tiny_model("llama")
    write_tasks(tmp_path)
    # No add_bos_token: lm-eval's remote backend never adds special tokens (against vLLM
    # too), so the huggingface run is told the same.
    common = {"model": model_dir.name, "batch_size": 4, "max_retries": 1, "max_length": 512}
    url = f"{cluster.http_url}/v1/completions"
    remote = evaluate("local-completions", {**common, "base_url": url,
                                            "tokenizer_backend": "remote"}, tmp_path)
    local = evaluate("local-completions", {**common, "base_url": url,
                                           "tokenizer": str(model_dir),
                                           "tokenizer_backend": "huggingface"}, tmp_path)
    for task in ("pd_mc", "pd_gen"):
        assert len(responses(remote, task)) == len(QUESTIONS)
        assert responses(remote, task) == responses(local, task), task
