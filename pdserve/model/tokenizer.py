"""Tokenizer wrapper over ``tokenizers`` plus incremental detokenization.

Streaming text must never show half a UTF-8 character or a piece that a later
token rewrites, so text is released by offsets, the way the serving systems
users know do it: decode a short window and emit only what is stable.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from pdserve.model.config import ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {model_dir}: only fast (tokenizers) "
                                 "tokenizers are supported; save one beside the weights "
                                 "(AutoTokenizer.from_pretrained(...).save_pretrained(DIR))")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = self.config.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items()
                            if t.special}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        import jinja2  # a dependency of transformers and of our HTTP server

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.config.get("bos_token", ""),
                               eos_token=self.config.get("eos_token", ""))


class IncrementalDetokenizer:
    """Turns a growing list of output ids into stable text deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        # Start the window inside the prompt so the first token's leading space decodes right.
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens, returns the text they make stable (may be '')."""
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
