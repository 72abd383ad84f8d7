"""`tpurec bench preprocess --quick` runs end to end against jax-tpu-embedding and reports every figure."""

import pytest

from tpurec.bench import preprocess as bench_preprocess

pytest.importorskip("jax_tpu_embedding")


def test_bench_preprocess_quick():
    out = bench_preprocess.run(quick=True, as_json=True, batch_size=256, num_features=3, repeats=1)
    for key in ("tpurec_samples_per_s", "jte_samples_per_s", "ratio_vs_jte", "pooling_1", "pooling_20", "threads"):
        assert key in out, key
    for pf in ("pooling_1", "pooling_20"):
        assert out[pf]["tpurec_samples_per_s"] > 0 and out[pf]["jte_samples_per_s"] > 0
    assert out["tpurec_samples_per_s"] > 0 and out["jte_samples_per_s"] > 0
    assert out["ratio_vs_jte"] == min(out["pooling_1"]["ratio_vs_jte"], out["pooling_20"]["ratio_vs_jte"])


def test_bench_preprocess_reports_every_round_and_the_load():
    out = bench_preprocess.run(quick=True, batch_size=64, num_features=2, repeats=4, poolings=(20,))
    p = out["pooling_20"]
    assert len(p["round_ratios"]) == 4 and p["min"] <= p["ratio_vs_jte"] <= p["max"]
    assert out["worst_round_ratio_vs_jte"] == p["min"] and len(out["load_average"]["start"]) == 3
    assert set(p["first_in_round"]) <= {"tpurec", "jte", "tpurec_loop"} and p["outputs_match"]


def test_bench_preprocess_refuses_unequal_outputs(monkeypatch):
    import tpurec.embedding.preprocess as pre

    real = pre.preprocess_tables

    def shifted(inputs, **kw):  # tpurec's side preprocesses other ids than jte's
        return real([(ids.flip(0), smp, g) for ids, smp, g in inputs], **kw)

    monkeypatch.setattr(pre, "preprocess_tables", shifted)
    with pytest.raises(bench_preprocess.UnequalWork, match="differs"):
        bench_preprocess.run(quick=True, batch_size=64, num_features=2, repeats=1, poolings=(20,))
