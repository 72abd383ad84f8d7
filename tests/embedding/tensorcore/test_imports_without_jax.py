"""tpurec and tpurec.embedding import without jax: only the tensorcore package imports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_embedding_package_imports_with_jax_blocked():
    # sys.modules["jax"] = None makes any `import jax` raise ImportError, as if it were not installed
    code = "import sys; sys.modules['jax'] = None; import tpurec, tpurec.embedding, tpurec.embedding.module"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
