"""#43: inputs that printed a traceback (or tried to allocate what the host cannot hold) and are now
one line, exit 2: a host-memory override that is not a number, `data stats --batch-size` beyond this
host's memory, and table names holding `$...$` in the PNG and HTML plan reports (drawn literally)."""

from __future__ import annotations

import json

import pytest

from tests.reliability.inproc import assert_refused, run_cli


@pytest.mark.parametrize("value", ["abc", "-5", "1.5e9"])
def test_a_host_memory_override_that_is_not_bytes_is_one_line(tmp_path, capsys, monkeypatch, value):
    monkeypatch.setenv("TPUREC_HOST_MEMORY_BYTES", value)
    code, _, err = run_cli(["data", "synth", "--rows", 100, "--out", tmp_path / "d", "--quiet"], capsys)
    assert_refused(code, err, f"TPUREC_HOST_MEMORY_BYTES={value!r}: not a whole number of bytes >= 0")
    assert not (tmp_path / "d").exists()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tpurec.cli import main

    path = tmp_path_factory.mktemp("data") / "d"
    assert main(["data", "synth", "--rows", "2000", "--out", str(path), "--quiet"]) == 0
    return path


def test_data_stats_refuses_a_batch_beyond_host_memory_before_allocating(dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TPUREC_HOST_MEMORY_BYTES", str(4 * 2**30))
    out = tmp_path / "limits.json"
    argv = ["data", "stats", dataset, "--model", "dlrm-tiny", "--topology", "v6e-4", "--out", out, "--quiet"]
    code, _, err = run_cli([*argv, "--batch-size", 1_000_000_000], capsys)  # was: allocate 416 GB, traceback
    assert_refused(code, err, "--batch-size 1,000,000,000: a global batch of 4,000,000,000 rows (4 devices) needs")
    assert "this host has 4.0 GiB available: at most" in err
    assert not out.exists()
    code, _, err = run_cli([*argv, "--batch-size", 256], capsys)  # an ordinary batch still runs
    assert code == 0, err
    assert json.loads(out.read_text())["layout"]["batch_size_per_device"] == 256


def test_bench_stats_refuses_a_batch_beyond_host_memory(dataset, capsys, monkeypatch):
    monkeypatch.setenv("TPUREC_HOST_MEMORY_BYTES", str(4 * 2**30))
    argv = ["bench", "stats", dataset, "--model", "dlrm-tiny", "--topology", "v6e-4", "--batch-size", 1_000_000_000]
    code, _, err = run_cli(argv, capsys)
    assert_refused(code, err, "--batch-size 1,000,000,000: a global batch of 4,000,000,000 rows (4 devices) needs")


@pytest.mark.parametrize("fmt", ["png", "html"])
def test_table_names_with_dollars_are_drawn_literally(tmp_path, capsys, fmt):
    tables = tmp_path / "tables.json"
    names = ["t_$x^{$", "$\\frac{a}{b}$"]
    tables.write_text(json.dumps([{"name": n, "num_embeddings": 100_000, "embedding_dim": 64} for n in names]))
    out = tmp_path / f"plan.{fmt}"
    code, _, err = run_cli(["plan", "--tables", tables, "--topology", "v6e-4", "--format", fmt, "--out", out], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert out.stat().st_size > 0
    if fmt == "html":
        assert "t_$x^{$" in out.read_text()


CONVERT_FLAGS = [
    (["--table-sizes", "abc"], "--table-sizes 'abc': entry 1 ('abc') is not a whole number"),
    (["--table-sizes", ",".join(["0"] * 26)], "entry 1 (0) must be in [1, 1,099,511,627,776]"),
    (["--npy-dense-min", "abc"], "--npy-dense-min 'abc': entry 1 ('abc') is not a whole number"),
]


@pytest.mark.parametrize("flags,says", CONVERT_FLAGS, ids=["sizes_abc", "sizes_0", "npy_min_abc"])
def test_convert_list_flags_that_are_not_numbers_are_one_line(tmp_path, capsys, flags, says):
    src = tmp_path / "day.tsv"
    src.write_text("1\t" + "\t".join(["5"] * 13) + "\t" + "\t".join(["a1"] * 26) + "\n")
    code, _, err = run_cli(["data", "convert", src, "--out", tmp_path / "out", "--quiet", *flags], capsys)
    assert_refused(code, err, says)
    assert not (tmp_path / "out").exists()


BENCH_FLAGS = [
    (["bench", "balance", "--batch-size", -1], "tpurec bench balance: error: argument --batch-size: '-1' must be > 0"),
    (["bench", "pipeline", "--batch-size", 0], "argument --batch-size: '0' must be > 0"),
    (["bench", "data", "--passes", 0], "argument --passes: '0' must be > 0"),
]


@pytest.mark.parametrize("argv,says", BENCH_FLAGS, ids=["balance_batch", "pipeline_batch", "data_passes"])
def test_bench_counts_below_one_are_one_line(capsys, argv, says):
    code, _, err = run_cli(argv, capsys)  # balance -1 was numpy's "negative dimensions" traceback
    assert_refused(code, err, says)
