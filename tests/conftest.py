"""Shared pytest set-up.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined,
so it is set here, before pytest imports any test module.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Every node, router and launch a test starts serves float32 (the token-exact comparisons
# with transformers are in float32), whatever `--dtype auto` would choose on this CPU;
# in-process engines pin it themselves. tests/e2e/test_dtype_auto.py clears it; modules
# that check no arithmetic pass tests/cluster.py's USERS_DTYPE, and test_readme.py runs
# the README as a user's terminal would, without it.
os.environ.setdefault("PDSERVE_DTYPE", "float32")

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
