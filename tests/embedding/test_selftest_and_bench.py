"""`tpurec selftest` and `tpurec bench kernels` run end to end (tiny sizes for the bench)."""
import json
import subprocess
import sys

from tpurec.embedding import bench_kernels, selftest


def test_cpu_selftest_passes_every_check():
    checks = selftest.cpu_checks(seed=1)
    names = [c.name for c in checks]
    assert any("FBGEMM" in n and "rowwise_adagrad" in n for n in names)
    assert any("adam" in n for n in names) and any("forward mean" in n for n in names)
    failed = [c for c in checks if not c.passed]
    assert not failed, failed
    assert all(c.max_error <= c.tolerance for c in checks)


def test_selftest_cli_json_and_tpu_refusal():
    out = subprocess.run([sys.executable, "-m", "tpurec.cli", "selftest", "--device", "cpu", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["device"] == "cpu" and doc["passed"] and len(doc["checks"]) >= 8
    from tpurec.device import tpu_status

    if not tpu_status().usable:
        out = subprocess.run([sys.executable, "-m", "tpurec.cli", "selftest", "--device", "tpu"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and "cannot run TPU kernels" in out.stdout


def test_bench_kernels_runs_and_reports_keys():
    r = bench_kernels.run(quick=True, poolings=[1, 3], num_tables=2, rows=1000, dim=16, batch=64)
    for key in ("tpurec_lookups_per_s", "fbgemm_lookups_per_s", "ratio_vs_fbgemm", "roofline"):
        assert key in r
    for p in (1, 3):
        e = r[f"pooling_{p}"]
        assert e["tpurec_lookups_per_s"] > 0 and e["fbgemm_lookups_per_s"] > 0 and e["torch_lookups_per_s"] > 0
        assert abs(e["ratio_vs_fbgemm"] - e["tpurec_lookups_per_s"] / e["fbgemm_lookups_per_s"]) < 1e-9
    assert r["ratio_vs_fbgemm"] == min(r["pooling_1"]["ratio_vs_fbgemm"], r["pooling_3"]["ratio_vs_fbgemm"])
    assert "pooling" in bench_kernels.format_table(r)
