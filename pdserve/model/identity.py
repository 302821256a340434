"""What a checkpoint is called and its fingerprint, read without loading it.

Apart from loader.py so that the router, which only names and compares models, imports no
torch (loader.py re-exports both for the nodes).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pdserve.model.config import ModelLoadError


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


def model_name(model_path: str | Path) -> str:
    """The name a checkpoint is served under: the folder's name, or the file's without .gguf."""
    model_path = Path(model_path)
    return model_path.name.removesuffix(".gguf") if model_path.is_file() else model_path.name


def model_identity_hash(model_path: str | Path) -> str:
    """A short fingerprint of config + weight files, so that nodes serving
    different weights under the same name are told apart."""
    model_path = Path(model_path)
    if model_path.is_file():
        from pdserve.model import gguf
        return gguf.identity_hash(model_path)
    h = hashlib.sha256((model_path / "config.json").read_bytes())
    for f in weight_files(model_path):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]
