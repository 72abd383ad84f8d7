import json

import pytest

from tests.helpers.plans import KERNEL, TABLES, run_plan, two_table_plan
from tpurec.planner import plan_io, report_html, report_png
from tpurec.planner import report as I
from tpurec.planner.estimators import shard_cost
from tpurec.planner.topology import parse_slice


def test_report_numbers_and_schema():
    spec = parse_slice("v6e-4")
    r = I.build_report(two_table_plan(), TABLES, spec, batch_size=8, optimizer="sgd", reserved=1000)
    for key in ("topology", "world_size", "fits", "estimated_step_time_ms", "tables", "devices"):
        assert key in r
    assert (r["topology"], r["world_size"], r["fits"]) == ("v6e-4", 4, True)
    ta = next(t for t in r["tables"] if t["name"] == "a")
    assert {k: ta[k] for k in ("rows", "dim", "sharding_type", "compute_kernel", "ranks", "bytes")} == {
        "rows": 1000,
        "dim": 16,
        "sharding_type": "table_wise",
        "compute_kernel": KERNEL,
        "ranks": [0],
        "bytes": 133952,  # 64512 weights + 832 buffers + 4096 activations + 64512 transient (SGD: no state)
    }
    b_shard = shard_cost(
        sharding_type="row_wise",
        rows=100,
        cols=16,
        pooling_factor=2.0,
        batch_per_device=8,
        world_size=4,
        num_shards=4,
        spec=spec,
        optimizer="sgd",
    )
    d0, d1 = r["devices"][0], r["devices"][1]
    assert d0["hbm_used_bytes"] == 1000 + 133952 + b_shard.bytes
    assert d0["transient_bytes"] == 64512 + b_shard.weights
    assert "transnt" in I.format_text(r)
    assert d1["hbm_used_bytes"] == 1000 + b_shard.bytes
    assert d1["hbm_capacity_bytes"] == 32 * 10**9
    assert r["estimated_step_time_ms"] == pytest.approx(d0["estimated_time_ms"])
    assert d0["estimated_time_ms"] == pytest.approx(d0["lookup_ms"] + d0["update_ms"] + d0["comm_ms"])
    assert r["assumptions"]["sc_gather_bw_bytes_per_s"] == pytest.approx(1638e9 * 0.3)
    assert r["time_imbalance"] > 1.0


def _cost(sharding_type, rows, pooling, spec, batch):
    return shard_cost(
        sharding_type=sharding_type,
        rows=rows,
        cols=16,
        pooling_factor=pooling,
        batch_per_device=batch,
        world_size=4,
        num_shards=4 if sharding_type == "row_wise" else 1,
        spec=spec,
        optimizer="sgd",
    )


@pytest.mark.parametrize("batch", [8, 4096])
def test_pipelined_step_time_is_the_longest_of_the_overlapped_stages(batch):
    # Device 0 holds table a (TW) and a shard of b (RW); the other devices a shard of b each. On v6e-4
    # both batches are SparseCore-bound (MLPerf DCNv2 on v5p-128 is bound by its collectives: docs).
    spec = parse_slice("v6e-4")
    r = I.build_report(two_table_plan(), TABLES, spec, batch_size=batch, optimizer="sgd")
    a, b = _cost("table_wise", 1000, 1.0, spec, batch), _cost("row_wise", 100, 2.0, spec, batch)
    sparsecore = a.lookup_ms + a.update_ms + b.lookup_ms + b.update_ms
    collectives = a.output_comm_ms + a.grad_comm_ms + b.output_comm_ms + b.grad_comm_ms
    inputs = a.input_comm_ms + b.input_comm_ms
    d0 = r["devices"][0]
    assert d0["pipelined_time_ms"] == pytest.approx(max(sparsecore, collectives, inputs))
    assert d0["estimated_time_ms"] == pytest.approx(sparsecore + collectives + inputs)
    assert r["pipelined_step_time_ms"] == pytest.approx(max(d["pipelined_time_ms"] for d in r["devices"]))
    assert r["pipelined_step_time_ms"] < r["estimated_step_time_ms"]
    assert f"pipelined step: {r['pipelined_step_time_ms']:.3f} ms" in I.format_text(r)


def test_cpu_plans_have_no_pipelined_step_time():
    spec = parse_slice("v6e-4")
    r = I.build_report(two_table_plan(), TABLES, spec, batch_size=8, optimizer="sgd", compute_device="cpu")
    assert r["pipelined_step_time_ms"] is None
    assert "pipelined step" not in I.format_text(r)


def test_text_and_diff():
    spec = parse_slice("v6e-4")
    r1 = I.build_report(two_table_plan(), TABLES, spec, batch_size=8, optimizer="sgd")
    r2 = I.build_report(two_table_plan((3, 2, 1, 0)), TABLES, spec, batch_size=8, optimizer="sgd")
    text = I.format_text(r1)
    assert "fits: yes" in text and "row_wise" in text and "top 5 tables by time" in text
    d = I.diff_reports(r1, r2)
    assert "1 of 2 tables differ" in d and "b: row_wise ranks 0,1,2,3 -> row_wise ranks 3,2,1,0" in d
    assert "a:" not in d


def test_png_and_html(tmp_path):
    r = I.build_report(two_table_plan(), TABLES, parse_slice("v6e-4"), batch_size=8, optimizer="sgd")
    png = report_png.png_bytes(r)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    page = report_html.html_page(r)
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page and '<td class="text">b</td>' in page


def test_cli_json_show_and_round_trip(tmp_path, capsys):
    assert run_plan("--model", "dlrm-tiny", "--topology", "v5p-8", "--batch-size", "64", "--format", "json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 4 and report["fits"] and len(report["tables"]) == 26
    assert {"rank", "hbm_used_bytes", "hbm_capacity_bytes", "estimated_time_ms"} <= set(report["devices"][0])
    out = tmp_path / "r.json"
    out.write_text(json.dumps(report))
    # the report is a plan file: load_plan reads it, and show recomputes the identical report
    assert len(plan_io.load_plan(out).plan[""]) == 26
    assert I.report_from_file(out) == report
    assert run_plan("show", str(out)) == 0
    assert "tables (largest first)" in capsys.readouterr().out
    assert run_plan("diff", str(out), str(out)) == 0
    assert "0 of 26 tables differ" in capsys.readouterr().out


def test_cli_tables_file_and_png(tmp_path, capsys):
    tables = tmp_path / "t.yaml"
    tables.write_text(
        "tables:\n  - {name: x, num_embeddings: 5000, embedding_dim: 32, pooling_factor: 4}\n"
        "  - {name: y, num_embeddings: 10, embedding_dim: 8}\n"
    )
    png = tmp_path / "p.png"
    assert run_plan("--tables", str(tables), "--topology", "v7x-8", "--format", "png", "--out", str(png)) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert run_plan("--tables", str(tables), "--topology", "cpu-2", "--format", "json") == 0
    assert json.loads(capsys.readouterr().out)["compute_device"] == "cpu"


def test_cli_refusal_exit_2(capsys):
    # (with the host tier, its default, it plans: tests/planner/test_host_tier_planning.py)
    assert run_plan("--model", "mlperf-dcnv2", "--topology", "v5p-8", "--optimizer", "adam", "--host-tier", "off") == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "largest table t_C21" in err and "free of 95.00 GiB" in err


def test_cli_bad_inputs(capsys):
    assert run_plan("--model", "dlrm-tiny", "--topology", "v5p-7") == 2
    assert "even" in capsys.readouterr().err
    assert run_plan("--model", "dlrm-tiny", "--topology", "h100-8") == 2
    assert "valid forms" in capsys.readouterr().err
    assert run_plan("--model", "dlrm-tiny") == 2
    assert run_plan("show") == 2


def test_show_and_diff_are_subcommands_with_their_own_help(tmp_path, capsys):
    for action, words in (("show", "Re-report a saved plan"), ("diff", "Which tables moved")):
        with pytest.raises(SystemExit) as e:
            run_plan(action, "-h")
        assert e.value.code == 0 and words in capsys.readouterr().out
    plan = str(tmp_path / "p.json")
    assert run_plan("--model", "dlrm-tiny", "--topology", "v5p-8", "--format", "json", "--out", plan) == 0
    capsys.readouterr()
    # --format before or after `show`
    for argv in (("--format", "json", "show", plan), ("show", plan, "--format", "json")):
        assert run_plan(*argv) == 0
        assert json.loads(capsys.readouterr().out)["world_size"] == 4
    assert run_plan("diff", plan) == 2
    assert "needs 2 plan file(s)" in capsys.readouterr().err


def test_cli_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, tpurec.planner.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
