"""transformers as the reference a benchmark measures pdserve against."""
from __future__ import annotations

import inspect
import os

import torch


def transformers_model(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """The transformers model of a checkpoint folder or a .gguf file (which transformers
    dequantizes itself), in eval mode."""
    import transformers

    model_dir = os.fspath(model_dir)
    where = ({"pretrained_model_name_or_path": os.path.dirname(model_dir),
              "gguf_file": os.path.basename(model_dir)} if os.path.isfile(model_dir)
             else {"pretrained_model_name_or_path": model_dir})
    return transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=dtype).eval()


class DecodeStepper:
    """transformers' own decode loop, one step at a time: the prompts' prefill with its
    KV cache, then one greedy token per sequence per ``step()``, as ``generate`` does
    without its sampling and stopping logic. Equal-length prompts (no padding)."""

    def __init__(self, model, prompts: torch.Tensor):  # prompts int64 [B, P]
        from transformers import DynamicCache

        self.model = model
        # transformers 5 renamed the forward's past_key_values= to cache=
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.cache = DynamicCache(config=model.config)
        self.pos = prompts.shape[1]
        with torch.inference_mode():
            self.next = self._forward(prompts, None)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                         **{self.cache_arg: self.cache})
        return out.logits[:, -1].argmax(-1)  # [B]

    @torch.inference_mode()
    def step(self) -> None:
        batch = self.next.shape[0]
        self.next = self._forward(self.next[:, None], torch.full((batch, 1), self.pos))
        self.pos += 1
