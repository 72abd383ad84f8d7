"""scripts/tpu_probe_host_link.py's smoke run (--device cpu): every piece timed at a tiny shape, sized
as the table tier's copies are (a padded bucket, the rows with their row-wise state)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
PIECES = ("host_gather", "host_scatter", "device_scatter", "device_gather", "load", "write_back")


def _script():
    return load_script("tpu_probe_host_link")


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


class _RowCopies:
    """TorchTPU's batch transfer as batch_transfer.py reads it (rows [so, so + n) into [do, do + n)),
    or, `ignore_dst`, a transfer that puts every range at row 0: what the probe must tell apart."""

    def __init__(self, ignore_dst: bool = False) -> None:
        self.ignore_dst = ignore_dst

    def _copy(self, srcs, dsts, src_off, dst_off, sizes):
        for s, d, so, do, n in zip(srcs, dsts, src_off, dst_off, sizes):
            d[(0 if self.ignore_dst else do) : (0 if self.ignore_dst else do) + n].copy_(s[so : so + n])

    batch_transfer_h2d_sync = batch_transfer_d2h_sync = _copy

    def batch_transfer_h2d(self, *args):
        self._copy(*args)
        return type("Future", (), {"wait": lambda self: None})()


def test_batch_transfer_pieces_say_whether_rows_arrived_where_read(monkeypatch):
    from tpurec.embedding.host_tier import batch_transfer

    probe = _script()
    for ignore_dst, want in ((False, True), (True, False)):
        monkeypatch.setattr(batch_transfer, "_module", lambda i=ignore_dst: _RowCopies(i))
        clock = probe.Clock(1, {"pieces": {}})
        probe.batch_transfers(clock, __import__("torch").device("cpu"), 64, 8, 1024, seed=3)
        pieces = clock.doc["pieces"]
        assert set(pieces) == {f"batch_{d}_{k}" for d in ("h2d", "d2h") for k in ("one", "runs")} | {
            "batch_h2d_one_async"
        }
        assert all("error" not in r for r in pieces.values()), pieces
        # one range at offset 0 arrives either way; the runs into scattered slots only as read
        assert pieces["batch_h2d_one"]["equal"] and pieces["batch_d2h_one"]["equal"]
        assert pieces["batch_h2d_runs"]["equal"] is want
        assert pieces["batch_h2d_runs"]["bytes"] == 64 * 8 * 4


def test_batch_transfer_refuses_ranges_it_cannot_mean():
    import pytest
    import torch

    from tpurec.embedding.host_tier.batch_transfer import check_ranges

    a, b = torch.zeros(10, 4), torch.zeros(20, 4)
    check_ranges([a], [b], [2], [12], [8])  # rows 2..10 into 12..20: fits
    with pytest.raises(ValueError, match=r"pair 0: rows \[3, 11\) of 10"):
        check_ranges([a], [b], [3], [0], [8])
    with pytest.raises(ValueError, match="differ in number"):
        check_ranges([a, a], [b], [0], [0], [1])
    with pytest.raises(ValueError, match="pair 0: rows of \\(4,\\) torch.float32 into \\(5,\\)"):
        check_ranges([a], [torch.zeros(20, 5)], [0], [0], [1])
    with pytest.raises(ValueError, match="contiguous"):
        check_ranges([torch.zeros(4, 10).t()], [torch.zeros(10, 4)], [0], [0], [1])


def test_jax_pieces_time_the_put_and_check_what_torch_receives(monkeypatch):
    """On the CPU, JAX's device is the host: the pieces run, the DLPack tensor equals what was put."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    probe = _script()
    clock = probe.Clock(1, {"pieces": {}})
    probe.jax_transfers(clock, [0.25], __import__("torch").device("cpu"))
    put, back = clock.doc["pieces"]["jax_put_0.25MB"], clock.doc["pieces"]["jax_to_torch_0.25MB"]
    assert "error" not in put and put["bytes"] == 2**18
    assert back["equal"] is True and back["device"] == "cpu"
    assert clock.doc["pieces"]["torch_to_jax_d2h_0.25MB"]["equal"] is True
