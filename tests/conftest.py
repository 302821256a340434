"""Shared pytest set-up.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined,
so it is set here, before pytest imports any test module.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Builds (once per session) a tiny random checkpoint per architecture: tiny_model("qwen2")."""
    from pdserve.model.make_model import make_model

    root = tmp_path_factory.mktemp("models")
    built = {}

    def get(arch: str = "llama", seed: int = 0):
        key = (arch, seed)
        if key not in built:
            built[key] = make_model(root / f"{arch}-{seed}", arch=arch, preset="tiny", seed=seed)
        return built[key]

    return get
