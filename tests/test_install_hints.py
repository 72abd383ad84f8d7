"""One way to install the TPU extra, said the same everywhere: `.venv/bin/pip install -r requirements/tpu.txt`.

tpurec is installed from a clone (`make install`; it is not on PyPI), so `pip install 'tpurec[tpu]'`
cannot work; `requirements/tpu.txt` must list exactly pyproject.toml's `tpu` extra."""

import re
import tomllib
from pathlib import Path

from tpurec.runtime.device import TpuStatus

REPO = Path(__file__).resolve().parents[1]
HINT = ".venv/bin/pip install -r requirements/tpu.txt"


def _requirements(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def test_tpu_requirements_file_is_the_tpu_extra():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tpu"]
    assert sorted(_requirements(REPO / "requirements" / "tpu.txt")) == sorted(extra)


def test_every_tpu_install_hint_is_the_same_command():
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "tpurec").rglob("*.py"))]
    seen = 0
    for path in texts:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert "tpurec[tpu]" not in line, f"{path.name}:{n}: {line.strip()}"
            if re.search(r"pip install\b.*(torch-tpu|libtpu|tpu\.txt)", line):
                assert HINT in line, f"{path.name}:{n}: {line.strip()}"
                seen += 1
    assert seen >= 3  # README, getting started, tpurec env's hint at least


def test_tpu_env_names_the_install_command_for_each_missing_piece():
    missing = TpuStatus(torch_tpu=None, libtpu=None, device_nodes=("/dev/accel0",)).missing()
    assert len(missing) == 2 and all(HINT in m for m in missing), missing
