"""`tpurec bench kernels` runs end to end (tiny sizes) and reports every figure."""

import statistics

from tpurec.bench import kernels as bench_kernels


def test_bench_kernels_runs_and_reports_keys():
    r = bench_kernels.run(quick=True, poolings=[1, 3], num_tables=2, rows=1000, dim=16, batch=64)
    for key in ("tpurec_lookups_per_s", "fbgemm_lookups_per_s", "ratio_vs_fbgemm", "roofline"):
        assert key in r
    for p in (1, 3):
        e = r[f"pooling_{p}"]
        assert e["tpurec_lookups_per_s"] > 0 and e["fbgemm_lookups_per_s"] > 0 and e["torch_lookups_per_s"] > 0
        assert len(e["rounds"]) == 2 and len(e["load_average_1min"]) == 2
        for run in e["rounds"]:
            assert abs(run["ratio_vs_fbgemm"] - run["tpurec_lookups_per_s"] / run["fbgemm_lookups_per_s"]) < 1e-9
        assert e["ratio_vs_fbgemm"] == statistics.median(run["ratio_vs_fbgemm"] for run in e["rounds"])
    assert r["ratio_vs_fbgemm"] == min(r["pooling_1"]["ratio_vs_fbgemm"], r["pooling_3"]["ratio_vs_fbgemm"])
    assert "load_average_1min_start" in r and "load_average_1min_end" in r
    assert "pooling" in bench_kernels.format_table(r) and "side-by-side rounds" in bench_kernels.format_table(r)


def test_bench_kernels_sequence_runs_both_contestants_and_reports_the_ratio():
    import torch.distributed as dist

    from tpurec.bench.sequence import format_sequence, run_sequence

    r = run_sequence(quick=True, num_tables=2, rows=500, dim=16, users=8, seq_len=5)
    (run,) = r["runs"]
    assert run["tpurec_ids_per_s"] > 0 and run["torchrec_ids_per_s"] > 0
    assert r["ratio_vs_torchrec"] == run["tpurec_ids_per_s"] / run["torchrec_ids_per_s"]
    assert r["workload"]["sequence_length"] == 5 and "median ratio" in format_sequence(r)
    assert not dist.is_initialized()  # the one-rank group it needed is gone
