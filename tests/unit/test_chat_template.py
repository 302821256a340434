"""Chat templates where checkpoints keep them: tokenizer_config.json (older checkpoints) and
chat_template.jinja (transformers 5), with transformers' precedence."""
import json
import shutil

import jinja2
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
            "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is a paged KV cache?"}]


@pytest.fixture(scope="module")
def saved_by_transformers(tiny_model, tmp_path_factory):
    """A checkpoint as transformers 5 saves it: model and tokenizer through save_pretrained."""
    src = tiny_model("llama")
    out = tmp_path_factory.mktemp("hf5") / "saved"
    tok = transformers.AutoTokenizer.from_pretrained(src)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(out)
    return out


def test_transformers5_layout_is_read(saved_by_transformers):
    out = saved_by_transformers
    # The layout this test is about: the template in its own file, not in the config.
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    hf = transformers.AutoTokenizer.from_pretrained(out)
    ours = Tokenizer(out)
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=False) == \
        hf.apply_chat_template(MESSAGES, tokenize=False)


def test_transformers5_checkpoint_chats_like_transformers(saved_by_transformers):
    """The whole checkpoint (config.json, weights, template) as transformers 5 wrote it
    generates what transformers generates from it."""
    out = saved_by_transformers
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    llm = LLM(dtype="float32", model=out)
    text = llm.tokenizer.apply_chat_template(MESSAGES)
    assert llm.tokenizer.encode(text, add_special_tokens=False) == ids
    ours = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=16, do_sample=False,
                             pad_token_id=0)
    assert ours[0].token_ids == seq[0, len(ids):].tolist()


def _folder(tmp_path, tiny_model, config_template=None, files=None):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_model("llama"), d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    if config_template is not None:
        cfg["chat_template"] = config_template
    cfg_path.write_text(json.dumps(cfg))
    for name, text in (files or {}).items():
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_text(text)
    return d


def test_jinja_file_wins_over_tokenizer_config(tmp_path, tiny_model):
    d = _folder(tmp_path, tiny_model, config_template="old {{ messages[0]['content'] }}",
                files={"chat_template.jinja": "new {{ messages[0]['content'] }}"})
    assert Tokenizer(d).apply_chat_template(MESSAGES) == "new Be brief."
    hf = transformers.AutoTokenizer.from_pretrained(d)
    assert hf.apply_chat_template(MESSAGES, tokenize=False) == "new Be brief."


def test_named_templates_and_legacy_list(tmp_path, tiny_model):
    d = _folder(tmp_path, tiny_model, config_template=[
        {"name": "default", "template": "legacy default"},
        {"name": "tool_use", "template": "legacy tools"}])
    tok = Tokenizer(d)
    assert tok.apply_chat_template(MESSAGES) == "legacy default"
    assert sorted(tok.chat_templates) == ["default", "tool_use"]
    d2 = _folder(tmp_path / "b", tiny_model, config_template="ignored",
                 files={"chat_templates/tool_use.jinja": "tools only"})
    with pytest.raises(ValueError, match="named \\['tool_use'\\] but no default"):
        Tokenizer(d2).apply_chat_template(MESSAGES)


def test_no_template_and_raise_exception(tmp_path, tiny_model):
    d = _folder(tmp_path, tiny_model)
    with pytest.raises(ValueError, match="chat_template.jinja"):
        Tokenizer(d).apply_chat_template(MESSAGES)
    d2 = _folder(tmp_path / "b", tiny_model, files={"chat_template.jinja": (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}ok")})
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        Tokenizer(d2).apply_chat_template(MESSAGES)
    assert Tokenizer(d2).apply_chat_template(MESSAGES[1:]) == "ok"
