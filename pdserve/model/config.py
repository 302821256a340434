"""Reads a Hugging Face ``config.json`` into the frozen ``ModelConfig`` the model is built from.

Checked at the edge: an unsupported architecture, rope type or missing key ends
here with an error that names what was found and what is supported, instead of
as a shape error deep inside a forward.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.model.errors import ModelLoadError  # noqa: F401 (where callers take it)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Per-frequency divisors, as llama.cpp stores Llama 3.1-style scaling (rope_freqs.weight).
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    torch_dtype: str | None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: a sliding window shorter than the context caps it,
        because our attention is full attention."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """The config of a checkpoint folder, or of a .gguf file (from its metadata)."""
        model_dir = Path(model_dir)
        if model_dir.is_file():
            from pdserve.model import gguf
            cfg = cls.from_dict(gguf.hf_config(model_dir), source=str(model_dir))
            gguf.check_types(model_dir)
            return cfg
        if not model_dir.is_dir():
            raise ModelLoadError(f"model folder {model_dir} does not exist")
        path = model_dir / "config.json"
        if not path.is_file():
            found = sorted(p.name for p in model_dir.iterdir())[:20]
            raise ModelLoadError(
                f"no config.json in {model_dir}: expected a Hugging Face checkpoint folder "
                f"(config.json, *.safetensors, tokenizer.json); found {found}"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        gen = {}
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text())
        return cls.from_dict(raw, generation_config=gen, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, generation_config: dict | None = None,
                  source: str = "config") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(raw.get("model_type", ""))
        if arch is None:
            found = archs or raw.get("model_type")
            raise ModelLoadError(
                f"unsupported architecture {found!r} in {source}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type "
                f"{', '.join(SUPPORTED_ARCHITECTURES.values())})"
            )
        model_type = SUPPORTED_ARCHITECTURES[arch]

        def need(key):
            if key not in raw:
                raise ModelLoadError(f"{source} has no {key!r}, which a {arch} needs")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}")
        if head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim={head_dim} must be even for rotary embedding")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported; "
                                 "supported: 'silu'")

        gen = generation_config or {}
        eos = gen.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(raw.get("attention_bias", model_type == "qwen2"))
        sliding = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            extra=raw,
        )


def _parse_rope(raw: dict, source: str) -> RopeConfig:
    """Reads both spellings: the legacy ``rope_theta`` + ``rope_scaling`` keys that most
    published checkpoints carry, and transformers 5's ``rope_parameters``."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported")
    kwargs = {"theta": float(theta), "rope_type": rope_type}
    if raw.get("rope_freq_factors") is not None:  # only from a GGUF file (gguf.py)
        kwargs["freq_factors"] = tuple(float(f) for f in raw["rope_freq_factors"])
    if rope_type in ("linear", "llama3"):
        if "factor" not in merged:
            raise ModelLoadError(f"{source}: rope type {rope_type!r} needs 'factor'")
        kwargs["factor"] = float(merged["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in merged:
                raise ModelLoadError(f"{source}: rope type 'llama3' needs {key!r}")
            kwargs[key] = type(getattr(RopeConfig, key))(merged[key])
    return RopeConfig(**kwargs)


def read_token_space(model_path: str | Path) -> tuple[int, tuple[int, ...], int]:
    """(vocabulary size, EOS ids, context length) of a checkpoint: all a simulated node
    needs of the model it stands in for (engine/sim_runner.py). A GGUF file's parsed
    reader is dropped at once (its parsed vocabulary, and the file's mapping)."""
    model_path = Path(model_path)
    cfg = ModelConfig.from_dir(model_path)
    if model_path.is_file():
        from pdserve.model import gguf
        gguf.release_readers()
    return cfg.vocab_size, tuple(cfg.eos_token_ids), cfg.max_model_len
