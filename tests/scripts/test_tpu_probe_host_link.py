"""scripts/tpu_probe_host_link.py's smoke run (--device cpu): every piece timed at a tiny shape, sized
as the table tier's copies are (a padded bucket, the rows with their row-wise state)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PIECES = ("host_gather", "host_scatter", "device_scatter", "device_gather", "load", "write_back")


def _script():
    spec = importlib.util.spec_from_file_location("tpu_probe_host_link", REPO / "scripts" / "tpu_probe_host_link.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_cpu_smoke_run_times_every_piece(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--device", "cpu", "--rows", "5000", "--cache-rows", "1000", "--dim", "16", "--n", "300"]
    doc = _script().main([*argv, "--sizes-mb", "0.5,1", "--reps", "2"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "link_partial.json").read_text()) == json.loads(json.dumps(doc))
    assert doc["device"] == "cpu" and doc["shape"]["bucket"] == 512  # 300 rows padded to a power of two
    assert set(doc["pieces"]) == {"h2d_0.5MB", "d2h_0.5MB", "h2d_1MB", "d2h_1MB", *PIECES}
    for name, rec in doc["pieces"].items():
        assert "error" not in rec, (name, rec)
        assert rec["ms"] >= rec["min_ms"] > 0
    assert doc["pieces"]["h2d_1MB"]["bytes"] == 2**20
    assert doc["pieces"]["load"]["bytes"] == 300 * 17 * 4  # the rows and their row-wise state
