"""The model pdserve serves when none is named.

``pdserve launch`` must work on a machine that cannot download anything, so
the default model is built from a seed on first use and cached under
``pdserve_home()``.  Processes that start together (a prefill and a decode
node, say) all ask for it at once: a lock file makes one of them build it
while the others wait, and make_model's atomic rename means nobody ever
reads half a checkpoint even without the lock.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from pdserve.model.make_model import make_model

# Bump the suffix whenever make_model would write different files, so that
# a stale cached copy is never served under the same name.
DEFAULT_MODEL_NAME = "pdserve-llama-small-v1"
DEFAULT_ARCH = "llama"
DEFAULT_PRESET = "small"
DEFAULT_SEED = 0


def pdserve_home() -> Path:
    """Where pdserve keeps its files: ``$PDSERVE_HOME``, else ``~/.cache/pdserve``."""
    home = os.environ.get("PDSERVE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "pdserve"


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def default_model_dir() -> Path:
    """The default checkpoint's folder, built on first use (once, even under races)."""
    model_dir = pdserve_home() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.parent / f".{DEFAULT_MODEL_NAME}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not _is_complete(model_dir):
            try:
                make_model(model_dir, DEFAULT_ARCH, DEFAULT_PRESET, DEFAULT_SEED)
            except FileExistsError:
                if not _is_complete(model_dir):
                    raise FileExistsError(
                        f"{model_dir} exists but is not a complete checkpoint; "
                        "delete it and pdserve will build it again"
                    ) from None
    return model_dir
