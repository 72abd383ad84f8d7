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
