"""`tpurec bench kernels` runs end to end (tiny sizes) and reports every figure."""

from tpurec.bench import kernels as bench_kernels


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
