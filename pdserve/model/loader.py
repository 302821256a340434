"""Loads a checkpoint into our model: a Hugging Face folder (safetensors, single file or
sharded) or a GGUF file (see gguf.py)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.common.config import MODEL_DTYPES
from pdserve.common.cpuinfo import native_bf16
from pdserve.model.config import ModelConfig, ModelLoadError
from pdserve.model.identity import (  # noqa: F401 (re-exported: the nodes' names)
    model_identity_hash,
    model_name,
    weight_files,
)
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.q8_head import Q8Embedding, Q8Head
from pdserve.model.quant import Int4Linear, plan

DTYPES = {name: getattr(torch, name) for name in MODEL_DTYPES}
# Keys some checkpoints carry that our model computes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def keeps_int4(model_path: str | Path, quantization: str) -> bool:
    """Whether a model served with ``--quantization`` QUANTIZATION would keep int4 weights
    from its file, served in bfloat16 (a GGUF file with Q4_0/Q4_1/Q4_K projections)."""
    from pdserve.model import gguf

    return quantization != "none" and Path(model_path).is_file() and \
        gguf.stores_int4(model_path)


def auto_dtype(cfg: ModelConfig | None, device: str | torch.device = "cpu",
               int4: bool = False) -> tuple[torch.dtype, str]:
    """What ``--dtype auto`` serves on ``device``, and why. On the CPU: bfloat16 where the
    CPU computes it natively (AVX512-BF16 or AMX-BF16), or where the weights stay int4
    (``int4``: keeps_int4) and pdserve's native kernels run, which take bfloat16
    activations and compute in float32 lanes (on AVX2 too); else float32, whatever the
    checkpoint stores: bfloat16 weights on a CPU without them are converted in every GEMM
    (torch's bfloat16 linear at 256 rows took 6 times float32's on an AVX2 EPYC).
    On an accelerator: the checkpoint's own, float32 where it names none we serve."""
    if torch.device(device).type == "cpu":
        flags = native_bf16()
        if flags:
            return torch.bfloat16, f"this CPU has {', '.join(flags)}"
        if int4:
            from pdserve.kernels import native

            if native.available():
                return torch.bfloat16, (
                    f"the file's int4 projections stay int4, and pdserve's native kernels "
                    f"run on this CPU ({native.isa()}): bfloat16 activations, float32 sums")
        return torch.float32, ("this CPU has neither AVX512-BF16 nor AMX-BF16, so bfloat16 "
                               "would be slower than float32")
    own = cfg.torch_dtype if cfg else None
    if own in DTYPES:
        return DTYPES[own], f"the checkpoint's own, on {device}"
    return torch.float32, (f"the checkpoint names {own or 'no dtype'}, not one of "
                           f"{', '.join(DTYPES)}")


def resolve_dtype(name: str | torch.dtype, cfg: ModelConfig | None = None,
                  device: str | torch.device = "cpu", int4: bool = False) -> torch.dtype:
    """The torch dtype of ``--dtype`` NAME; "auto" as ``auto_dtype`` chooses on ``device``
    (``int4``: the weights would stay int4; ``served_dtype`` finds that out)."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype {name} is not supported; supported: {', '.join(DTYPES)}")
        return name
    if name == "auto":
        return auto_dtype(cfg, device, int4)[0]
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; supported: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def served_dtype(name: str | torch.dtype, cfg: ModelConfig, device: str | torch.device,
                 model_path: str | Path, quantization: str) -> tuple[torch.dtype, str | None]:
    """The dtype a model is served in under ``--dtype`` NAME and ``--quantization``, and
    for "auto" why (None otherwise): what ``load_model`` loads and the engine logs."""
    if name == "auto":
        return auto_dtype(cfg, device, keeps_int4(model_path, quantization))
    return resolve_dtype(name, cfg, device), None


def load_config(model_path: str | Path) -> ModelConfig:
    """The config of a checkpoint folder or of a .gguf file."""
    return ModelConfig.from_dir(model_path)


def _safetensors(model_dir: Path, expected: dict, dtype: torch.dtype, device):
    """Yields (name or None, name in the file, tensor or None) like gguf.iter_tensors."""
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if key in expected:
                    yield key, key, sf.get_tensor(key).to(device=device, dtype=dtype)
                elif key.endswith(_IGNORED_SUFFIXES) or key == "lm_head.weight":
                    continue  # tied: the embedding is the head
                else:
                    yield None, key, None


def load_model(model_path: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", quantization: str = "none"
               ) -> LlamaForCausalLM:
    """Loads a Hugging Face checkpoint folder or a .gguf file. ``quantization``
    (EngineConfig's): "none" dequantizes every weight into ``dtype``; "auto" and "int4"
    keep a GGUF's Q4_0/Q4_1/Q4_K projections in their blocks where model/quant.py's ``plan``
    allows (ValueError where "int4" or "int8" cannot be had), and on the CPU its Q8_0
    embedding (and LM head) where model/q8_head.py's ``why_not`` allows."""
    model_path = Path(model_path)
    cfg = load_config(model_path)
    torch_dtype = served_dtype(dtype, cfg, device, model_path, quantization)[0]
    int4 = plan(quantization, model_path.is_file(), torch_dtype, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    if model_path.is_file():
        from pdserve.model import gguf
        tensors = gguf.iter_tensors(model_path, cfg, torch_dtype, int4,
                                    q8=int4 and torch.device(device).type == "cpu")
    else:
        tensors = _safetensors(model_path, expected, torch_dtype, device)
    state: dict[str, torch.Tensor] = {}
    kept: dict[str, Int4Linear] = {}   # module name → its int4 weight
    tables: dict[str, Q8Embedding] = {}  # module name → its Q8_0 weight (model/q8_head.py)
    unexpected = []
    for key, file_key, tensor in tensors:
        if key in expected and isinstance(tensor, Int4Linear):
            kept[key.removesuffix(".weight")] = tensor
        elif key in expected and isinstance(tensor, Q8Embedding):
            tables[key.removesuffix(".weight")] = tensor
        elif key in expected:
            state[key] = tensor.to(device)
        else:
            unexpected.append(file_key)
    if quantization == "int4" and not kept:
        raise ValueError(f"quantization 'int4': {model_path} has no Q4_0, Q4_1 or Q4_K projection "
                         "weights to keep; use 'auto' or 'none'")
    missing = sorted(set(expected) - set(state) - {f"{k}.weight" for k in [*kept, *tables]})
    if missing:
        raise ModelLoadError(f"checkpoint {model_path} lacks {len(missing)} weights the "
                             f"{cfg.architecture} needs, e.g. {missing[:5]}")
    if unexpected:
        raise ModelLoadError(f"checkpoint {model_path} has {len(unexpected)} weights a "
                             f"{cfg.architecture} does not use, e.g. {unexpected[:5]}")
    shapes = {**{k: tuple(t.shape) for k, t in state.items()},
              **{f"{k}.weight": (m.out_features, m.in_features) for k, m in kept.items()},
              **{f"{k}.weight": (t.num_embeddings, t.embedding_dim) for k, t in tables.items()}}
    for key, shape in shapes.items():
        want = tuple(expected[key].shape)
        if shape != want:
            raise ModelLoadError(f"weight {key} has shape {shape}, the config implies {want}")
    for name, lin in kept.items():
        lin.bias = state.pop(f"{name}.bias", None)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, lin)
    for name, table in tables.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr,
                Q8Head(table) if name == "lm_head" else table)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.init_rope(device)
    return model.eval().requires_grad_(False)
