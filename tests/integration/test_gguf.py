"""GGUF checkpoints: a tiny make-model checkpoint written as llama.cpp writes GGUF files
(tests/gguf_files.py) loads into the same model, config and tokenizer as the folder, and
files pdserve cannot serve are refused with a reason."""
import subprocess
import sys

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model import gguf
from pdserve.model.config import ModelConfig, ModelLoadError
from pdserve.model.loader import load_model, model_name
from pdserve.model.tokenizer import Tokenizer

gguf_files = pytest.importorskip("tests.gguf_files")

TEXTS = ["The quick brown fox", "Serving systems batch 12345 requests.\n\n  Indented",
         "é ü ß 日本 <|im_end|> after"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]


@pytest.fixture(scope="module")
def as_gguf(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(arch: str, qtype: str = "F32"):
        if (arch, qtype) not in made:
            made[arch, qtype] = gguf_files.write_gguf(tiny_model(arch),
                                                      root / f"{arch}-{qtype}.gguf", qtype)
        return made[arch, qtype]
    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_weights_config_and_greedy_equal_the_folder(tiny_model, as_gguf, arch):
    folder, path = tiny_model(arch), as_gguf(arch)
    ref, ours = load_model(folder), load_model(path)
    # Every weight under its Hugging Face name, q/k rows unpermuted: bit for bit.
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert sorted(our_sd) == sorted(ref_sd)
    for key in ref_sd:
        assert torch.equal(our_sd[key], ref_sd[key]), key
    a, b = ModelConfig.from_dir(folder), ModelConfig.from_dir(path)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                  "tie_word_embeddings", "attention_bias", "bos_token_id",
                  "max_position_embeddings"):
        assert getattr(a, field) == getattr(b, field), field
    assert b.eos_token_ids == a.eos_token_ids[:1]  # the file names one eos here
    # Llama 3.1-style rope arrives as llama.cpp's per-frequency factors: same table.
    assert torch.allclose(ours.cos_sin, ref.cos_sin, atol=1e-5)
    prompts = [[5, 9, 200, 31], list(range(3, 40))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(dtype="float32", model=folder).generate(prompts, params)]
    assert [o.token_ids for o in LLM(dtype="float32", model=path).generate(prompts, params)] == want


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_from_metadata_equals_tokenizer_json(tiny_model, as_gguf, arch):
    ref, ours = Tokenizer(tiny_model(arch)), Tokenizer(as_gguf(arch))
    assert ours.vocab_size == ref.vocab_size
    assert ours.special_ids == ref.special_ids
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.apply_chat_template(MESSAGES) == ref.apply_chat_template(MESSAGES)


def test_quantized_weights_are_dequantized(tiny_model, as_gguf):
    ref = load_model(tiny_model("llama")).state_dict()
    for qtype, tolerance in (("Q8_0", 0.01), ("Q4_0", 0.15)):
        model = load_model(as_gguf("llama", qtype), dtype="bfloat16")
        for key, w in model.state_dict().items():
            assert w.dtype == torch.bfloat16
            err = (w.float() - ref[key]).abs().max() / ref[key].abs().max()
            assert err < tolerance, (qtype, key, float(err))
    out = LLM(dtype="float32", model=as_gguf("llama", "Q8_0")).generate(
        "Hello", SamplingParams(max_tokens=4))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize("qtype, dtype", [("F32", "float32"), ("Q4_1", "bfloat16")])
def test_an_engine_keeps_nothing_of_the_file_once_built(as_gguf, qtype, dtype):
    """After loading, the engine drops the file's parsed reader (its vocabulary, and the
    file's mapping), and no tensor it keeps (weights, int4 blocks and scales, norms)
    lies in the file's mapping: each owns its memory, and it still serves."""
    path = as_gguf("llama", qtype)
    data = gguf.reader(path).data           # the mapping stays while we hold it
    start, end = data.ctypes.data, data.ctypes.data + data.nbytes
    llm = LLM(model=path, dtype=dtype, quantization="auto")
    assert gguf._reader.cache_info().currsize == 0
    seen = 0
    for module in llm.engine.model.modules():
        for t in vars(module).values():
            for t in (t.values() if isinstance(t, dict) else [t]):
                # (oneDNN's reordered weights are opaque: its own allocations, no storage)
                if isinstance(t, torch.Tensor) and not t.is_meta and not t.is_mkldnn:
                    seen += 1
                    assert not start <= t.untyped_storage().data_ptr() < end, module
    assert seen >= 5  # the norms, the embedding and the rotary table at least
    out = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_served_name_drops_the_suffix(as_gguf, tiny_model):
    assert model_name(as_gguf("llama")) == "llama-F32"
    assert model_name(tiny_model("llama")) == tiny_model("llama").name


def test_unsupported_quantization_type_is_refused(tmp_path):
    path = gguf_files.write_unsupported(tmp_path / "iq2.gguf", "IQ2_XXS")
    with pytest.raises(ModelLoadError, match=r"IQ2_XXS \(e\.g\. token_embd\.weight\).*"
                                             r"supported: F32, F16, BF16, Q8_0"):
        ModelConfig.from_dir(path)
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--model", str(path),
                          "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "IQ2_XXS" in out.stderr and "Traceback" not in out.stderr


def test_unsupported_architecture_and_not_a_gguf(tmp_path):
    path = gguf_files.write_unsupported(tmp_path / "g.gguf", "F16", arch="gemma")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gemma'; "
                                             "supported: llama, qwen2"):
        load_model(path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a .gguf checkpoint"):
        ModelConfig.from_dir(other)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        ModelConfig.from_dir(broken)


def test_sentencepiece_tokenizer_matches_transformers(tiny_model, tmp_path):
    """A SentencePiece vocabulary (tokenizer.ggml.model 'llama': Llama 2, Mistral 7B) is
    rebuilt as transformers rebuilds it from the same file."""
    transformers = pytest.importorskip("transformers")
    from pathlib import Path

    import pdserve.model.make_model as mm

    corpus = (Path(mm.__file__).parent / "data" / "corpus.txt").read_text().split("\n\n")
    vocab = gguf_files.sentencepiece_vocab(corpus)
    path = gguf_files.write_gguf(tiny_model("llama"), tmp_path / "spm.gguf",
                                 add_tokenizer=gguf_files.add_sentencepiece(*vocab))
    ours = Tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [*TEXTS, " two  spaces\nand a line", "Zebra-quokka ∮ ☃ 𝄞", "</s> <s>x"]:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ids[0] == 1  # BOS, as llama.cpp adds it to SentencePiece vocabularies
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
