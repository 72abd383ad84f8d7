"""One way to install the TPU extra, said the same everywhere: `.venv/bin/pip install -r requirements/tpu.txt`.

tpurec is installed from a clone (`make install`; it is not on PyPI), so `pip install 'tpurec[tpu]'`
cannot work; `requirements/tpu.txt` must list exactly pyproject.toml's `tpu` extra."""

import re
import tomllib
from pathlib import Path

import pytest

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


def test_the_tpu_extra_pins_the_libtpu_torch_tpu_asks():
    assert "libtpu>=0.0.50" in _requirements(REPO / "requirements" / "tpu.txt")


@pytest.mark.parametrize(
    "version,problem",
    [
        (
            "0.0.42.1",  # JAX's, as on the v5e chip
            "libtpu 0.0.42.1 is older than the 0.0.50 torch-tpu 0.2.0 asks and has 4 parts, where torch-tpu 0.2.0's "
            "loader parses only 3 (major.minor.patch): .venv/bin/pip install -r requirements/tpu.txt",
        ),
        (
            "0.0.49",
            "libtpu 0.0.49 is older than the 0.0.50 torch-tpu 0.2.0 asks: "
            ".venv/bin/pip install -r requirements/tpu.txt",
        ),
        (
            "0.0.52.1",
            "libtpu 0.0.52.1 has 4 parts, where torch-tpu 0.2.0's loader parses only 3 (major.minor.patch): "
            ".venv/bin/pip install -r requirements/tpu.txt",
        ),
        ("0.0.50", None),
        ("0.1.0", None),
        (None, None),
    ],
)
def test_tpurec_env_flags_a_libtpu_torch_tpu_cannot_take(monkeypatch, capsys, version, problem):
    import argparse

    from tpurec import env_report
    from tpurec.runtime import device

    status = TpuStatus(torch_tpu="0.2.0", libtpu=version, device_nodes=("/dev/accel0",))
    monkeypatch.setattr(device, "tpu_status", lambda: status)
    assert env_report.run(argparse.Namespace(json=False)) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "libtpu" in line]
    assert warnings == ([f"warning: {problem}"] if problem else [])
    assert env_report.collect()["libtpu_problem"] == problem
