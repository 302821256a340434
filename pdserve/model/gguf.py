"""GGUF checkpoints (llama.cpp's single-file format) read into our Llama-family model.

A GGUF holds the config as metadata under ``{arch}.*`` keys, the tokenizer under
``tokenizer.*`` (see gguf_tokenizer.py) and the weights under llama.cpp's names, most of
them quantized in blocks. Loading:

    1. the metadata becomes the ``config.json`` dict Hugging Face would have written, so
       it goes through the same checks (``ModelConfig.from_dict``, called by
       ``ModelConfig.from_dir``, so this module never imports config.py) as a folder does
    2. every tensor's quantization type is checked before anything is dequantized
    3. each tensor is dequantized (the ``gguf`` package's reference code) into the serving
       dtype under its Hugging Face name, or, with ``--quantization`` auto or int4, a
       Q4_0/Q4_1/Q4_K projection kept in its blocks (model/quant.py); for the llama
       architecture the q/k rows go back from llama.cpp's rotary layout (interleaved
       pairs) to Hugging Face's (halves)
"""
from __future__ import annotations

import hashlib
import logging
import sys
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from pdserve.model.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from pdserve.model.config import ModelConfig
    from pdserve.model.q8_head import Q8Embedding
    from pdserve.model.quant import Int4Linear

log = logging.getLogger(__name__)

# general.architecture → (Hugging Face architecture, whether llama.cpp permuted q/k rows).
# Mistral's files say "llama": llama.cpp converts MistralForCausalLM as a llama.
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}
# Dequantized with the gguf package's reference code; others (IQ*, TQ*, ...) are refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                   "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_IN_CONFIG = ("rope_freqs.weight",)  # read into the config by hf_config
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


def _gguf_module():
    try:
        import gguf
    except ImportError as exc:  # a dependency; only a broken install lacks it
        raise ModelLoadError("reading a .gguf checkpoint needs the 'gguf' package "
                             "(pip install gguf)") from exc
    return gguf


@lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int):
    _gguf_module()  # (gguf_file reads the package's constants)
    from pdserve.model.gguf_file import GGUFFile

    try:
        return GGUFFile(path)
    except Exception as exc:  # ValueErrors saying where, the package's enums' ValueErrors
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def reader(path: str | Path):
    """The file's metadata and tensors (gguf_file.GGUFFile: memory-mapped; parsed once per
    process)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file {path} does not exist")
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is a file but not a .gguf checkpoint; --model takes a "
                             "Hugging Face checkpoint folder or a .gguf file")
    return _reader(str(path.resolve()), path.stat().st_mtime_ns)


def release_readers() -> None:
    """Forgets the parsed readers: the bundled 135M model's parsed metadata holds about
    9 MiB (its vocabulary and merges as strings), and the file stays mapped while a reader
    is held. The router (which reads a file's config and tokenizer, never its tensors)
    calls it after start-up, an engine once loaded (Worker.release_load_memory)."""
    _reader.cache_clear()


def metadata(r) -> dict:
    """The file's key/value metadata as Python values (the token arrays are left out)."""
    out = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                              "tokenizer.ggml.token_type",
                                              "tokenizer.ggml.scores"):
            continue
        out[key] = field.contents()
    return out


def hf_config(path: str | Path) -> dict:
    """The config.json a Hugging Face checkpoint of this file would have."""
    r = reader(path)
    meta = metadata(r)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(ARCHITECTURES)} (Mistral files say 'llama')")
    names = {t.name: t for t in r.tensors}

    def need(key):
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelLoadError(f"{path} has no {full!r}, which a {arch} model needs")
        return meta[full]

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    raw = {
        "architectures": [ARCHITECTURES[arch][0]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        # Stored as float32: 1e-5 reads back as 9.99999974e-06; keep the value people wrote.
        "rms_norm_eps": float(str(np.float32(need("attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
    }
    if "rope_freqs.weight" in names:  # Llama 3.1-style scaling, precomputed by llama.cpp
        freqs = names["rope_freqs.weight"]
        raw["rope_freq_factors"] = _gguf_module().quants.dequantize(
            freqs.data, freqs.tensor_type).reshape(-1).tolist()
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        raw["rope_scaling"] = {"rope_type": scaling,
                               "factor": meta.get(f"{arch}.rope.scaling.factor")}
    return raw


def _eos_ids(meta: dict) -> list[int]:
    """End of sequence and, where the file names them, end of turn and of message."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def check_types(path: str | Path) -> None:
    """Refuses a file with any tensor in a quantization type we cannot dequantize."""
    bad = {}
    for t in reader(path).tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            bad.setdefault(t.tensor_type.name, t.name)
    if bad:
        found = ", ".join(f"{q} (e.g. {name})" for q, name in bad.items())
        raise ModelLoadError(f"{path} holds tensors in quantization types pdserve does not "
                             f"dequantize: {found}; supported: {', '.join(SUPPORTED_TYPES)}")


def stores_int4(path: str | Path) -> bool:
    """Whether any projection weight of the file is in a type that can stay int4
    (quant.keeps)."""
    from pdserve.model.quant import keeps

    return any((hf := hf_name(t.name)) is not None and keeps(hf, t.tensor_type.name) is None
               for t in reader(path).tensors)


def hf_name(name: str) -> str | None:
    """llama.cpp's tensor name → Hugging Face's; None for one we do not know."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k permutation: per head, rows (pair i, half h) back to (half h,
    pair i), i.e. interleaved rotary pairs back to Hugging Face's rotate-half layout."""
    rows = w.shape[0]  # [H * D, ...] for weights, [H * D] for biases
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])  # [H, D/2, 2, ...]
            .transpose(1, 2).reshape(w.shape))                         # [H, 2, D/2, ...]


def iter_tensors(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, int4: bool = False,
                 q8: bool = False
                 ) -> Iterator[tuple[str | None, str, torch.Tensor | Int4Linear | Q8Embedding
                                     | None]]:
    """Yields (Hugging Face name or None, GGUF name, tensor in ``dtype`` or None). With
    ``int4``, a Q4_0/Q4_1/Q4_K projection comes as an unpacked Int4Linear (model/quant.py),
    and one log line at the end says what stayed int4 and what was dequantized why. With
    ``q8`` (a CPU model), a Q8_0 embedding or LM head comes as a Q8Embedding
    (model/q8_head.py) where ``q8_head.why_not`` allows, and that line says so too."""
    import torch  # here, not above: the router reads a GGUF's config and imports no torch

    from pdserve.model import q8_head, quant

    gguf = _gguf_module()
    permuted = ARCHITECTURES[cfg.model_type][1]
    kept, types, dequantized, kept_q8 = [], set(), {}, []
    for t in _progress(reader(path).tensors, f"loading {Path(path).name}"):
        name = hf_name(t.name)
        if t.name in _IN_CONFIG:
            continue
        if name is None:
            yield None, t.name, None
            continue
        qtype = t.tensor_type.name
        if q8 and name in q8_head.NAMES:
            why_not = q8_head.why_not(name, qtype, dtype)
            if why_not is None:
                table = q8_head.Q8Embedding.from_gguf(t.data, dtype)
                kept_q8.append((t.name, table))
                yield name, t.name, table
                continue
        else:
            why_not = quant.keeps(name, qtype) if int4 else "off"
        if why_not is None:
            try:
                lin = quant.Int4Linear.from_gguf(t.data, qtype, dtype)
            except quant.QuantError as exc:
                why_not = f"{qtype}: {exc}"
            else:
                if permuted and ".q_proj." in name:
                    lin.permute_rows(lambda w: unpermute_rows(w, cfg.num_attention_heads))
                elif permuted and ".k_proj." in name:
                    lin.permute_rows(lambda w: unpermute_rows(w, cfg.num_key_value_heads))
                kept.append((lin.out_features, lin.in_features))
                types.add(qtype)
                yield name, t.name, lin
                continue
        if int4 and qtype not in ("F32", "F16", "BF16"):
            dequantized.setdefault(why_not, []).append(t.name)
        # torch.tensor copies into torch's (aligned) memory: F32 data is the file's mmap.
        tensor = torch.tensor(gguf.quants.dequantize(t.data, t.tensor_type), dtype=torch.float32)
        if permuted and ".q_proj." in name:
            tensor = unpermute_rows(tensor, cfg.num_attention_heads)
        elif permuted and ".k_proj." in name:
            tensor = unpermute_rows(tensor, cfg.num_key_value_heads)
        yield name, t.name, tensor.to(dtype)
    if int4:
        log.info("%s%s", quant.summary(kept, types, dtype, dequantized),
                 q8_head.summary(kept_q8, dtype, cfg.tie_word_embeddings))


def identity_hash(path: str | Path) -> str:
    """Metadata and tensor layout (the file's head) plus its size: cheap, and different
    for different weights in practice."""
    path = Path(path)
    h = hashlib.sha256(f"{path.name}:{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _progress(items, desc: str):
    """A progress bar on stderr (tqdm's if it is installed) when stderr is a terminal."""
    log.info("%s: %d tensors", desc, len(items))
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, desc=desc, unit="tensor", disable=None, leave=False)
        return
    show = sys.stderr.isatty()
    for i, item in enumerate(items):
        if show:
            done = (i + 1) * 30 // len(items)
            sys.stderr.write(f"\r{desc} [{'#' * done}{'.' * (30 - done)}] {i + 1}/{len(items)}")
        yield item
    if show:
        sys.stderr.write("\n")
