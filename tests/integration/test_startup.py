"""`pdserve submit` and the queue client start without loading torch (or numpy): a producer
that sends a prompt should not pay for the model's stack."""
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "transformers")


@pytest.mark.parametrize("code", [
    "import pdserve.client",
    "from pdserve.cli import main; main(['submit', '--help'], standalone_mode=False)",
])
def test_no_heavy_import(code):
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
