"""`tpurec bench pipeline` on a reduced size: both sides run on the same batches in a pinned child."""

import pytest

from tpurec.bench import pipeline as bench_pipeline

pytest.importorskip("jax_tpu_embedding")


@pytest.mark.slow  # ~15 s idle, 45 s on a loaded host: a child process importing jax and torch
def test_bench_pipeline_small(tmp_path):
    out = bench_pipeline.run_bench(batch_size=128, steps=3, cores=[1], repeats=1, warmup=0, data_dir=str(tmp_path))
    one = out["cores_1"]
    assert one["steps"] == 3 and one["ids_per_step"] == 128 * 214  # the MLPerf multi-hot shape
    assert one["ids_per_s_per_core"] == out["ids_per_s_per_core"] > 0
    assert one["jte_samples_per_s"] > 0 and out["ratio_vs_jte"] == one["ratio_vs_jte"] > 0
    for key in (
        "read_kjt_cpu_ms",
        "csr_build_cpu_ms",
        "ids_per_cpu_s",
        "copy_gb_per_s",
        "csr_slots_per_step",
        "jte_csr_slots_per_step",
    ):
        assert one[key] > 0, key
    assert out["fraction_of_goal"] == round(one["ids_per_s_per_core"] / bench_pipeline.GOAL_IDS_PER_S_PER_CORE, 3)


@pytest.mark.slow
def test_bench_pipeline_reports_every_round_and_the_load(tmp_path):
    out = bench_pipeline.run_bench(batch_size=64, steps=2, cores=[1], repeats=3, warmup=0, data_dir=str(tmp_path))
    one = out["cores_1"]
    assert len(one["round_ratios"]) == 3 and one["min"] <= one["ratio_vs_jte"] <= one["max"]
    assert out["worst_round_ratio_vs_jte"] == one["min"] and len(out["load_average"]["start"]) == 3
    assert len(one["first_in_round"]) == 3
