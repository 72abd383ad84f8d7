"""scripts/tpu_probe_lookup_pool.py's smoke run (--cpu): every lookup variant and pooling option timed,
each lookup variant equal to the kernel's lookup (checked inside the run, reported here)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script


@pytest.mark.slow  # ~45 s: ten interpreted Pallas programs; the pooling options' own tests are in the default run
def test_cpu_smoke_run_times_every_pooling_option_against_the_lookup(tmp_path):
    script = load_script("tpu_probe_lookup_pool")
    out = tmp_path / "lp.json"
    doc = script.main(["--cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    (c,) = doc["cells"]
    lookups = {f"lookup_a{r}{g}" for r in (1, 4, 8) for g in ("", "_gains")}
    want = {"xla", "lookup", "xla_pool", "decode_gather"} | lookups
    assert set(c["ms"]) == want | {f"pool_only_a{r}" for r in (1, 4, 8)}
    assert min(c["ms"].values()) > 0 and c["slots"] >= c["ids"] == 32 * 4
    assert set(c["max_error_vs_lookup"]) == set(c["ms"]) - {"decode_gather"}
    assert max(c["max_error_vs_lookup"].values()) <= 1e-4
