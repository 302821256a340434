"""Loads a Hugging Face safetensors checkpoint (single file or sharded) into our model."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.model.config import ModelConfig, ModelLoadError
from pdserve.model.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Keys some checkpoints carry that our model computes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(name: str | torch.dtype, cfg: ModelConfig | None = None) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype {name} is not supported; supported: {', '.join(DTYPES)}")
        return name
    if name == "auto":
        name = (cfg.torch_dtype if cfg else None) or "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; supported: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {missing}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.iterdir()
                        if p.suffix in (".bin", ".pt", ".pth", ".gguf", ".ckpt"))
        hint = f"; found {others}, which are not supported" if others else ""
        raise ModelLoadError(
            f"no weights in {model_dir}: expected model.safetensors or sharded "
            f"model-*.safetensors with model.safetensors.index.json{hint}")
    return files


def model_identity_hash(model_dir: str | Path) -> str:
    """A short fingerprint of config + weight files, so that nodes serving
    different weights under the same name are told apart."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in weight_files(model_dir):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg)
    files = weight_files(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if key in expected:
                    state[key] = sf.get_tensor(key).to(device=device, dtype=torch_dtype)
                elif not key.endswith(_IGNORED_SUFFIXES) and key != "lm_head.weight":
                    unexpected.append(key)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint {model_dir} lacks {len(missing)} weights the "
                             f"{cfg.architecture} needs, e.g. {missing[:5]}")
    if unexpected:
        raise ModelLoadError(f"checkpoint {model_dir} has {len(unexpected)} weights a "
                             f"{cfg.architecture} does not use, e.g. {unexpected[:5]}")
    for key, tensor in state.items():
        want = tuple(expected[key].shape)
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"weight {key} has shape {tuple(tensor.shape)}, config.json "
                                 f"implies {want}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.init_rope(device)
    return model.eval().requires_grad_(False)
