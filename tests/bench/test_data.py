import json


def test_bench_data_code_path_emits_the_keys(tmp_path, capsys):
    """Not a timing test: a tiny run of `tpurec bench data` must work and report every figure."""
    from tpurec.cli import main

    assert (
        main(
            [
                "bench",
                "data",
                "--rows",
                "20000",
                "--convert-rows",
                "2000",
                "--passes",
                "1",
                "--tables",
                "dlrm-tiny",
                "--dir",
                str(tmp_path),
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    for key in (
        "tpurec_samples_per_s",
        "torchrec_samples_per_s",
        "ratio_vs_torchrec",
        "tpurec_in_memory_samples_per_s",
        "converter_mb_per_s",
        "ratio_vs_torchrec_cpu",
        "tpurec_decode_threads_samples_per_s",
    ):
        assert res[key] > 0
    assert res["tpurec_decode_threads"] >= 1
    assert res["rows"] == 20000 and res["batch_size"] == 8192
    assert abs(res["ratio_vs_torchrec"] - res["tpurec_samples_per_s"] / res["torchrec_samples_per_s"]) < 2e-3


def test_bench_without_a_benchmark_shows_help(capsys):
    from tpurec.cli import main

    assert main(["bench"]) == 2
    assert "data" in capsys.readouterr().out


def test_bench_data_on_a_multi_hot_table_set_measures_tpurec_and_says_why_torchrec_is_skipped(tmp_path, capsys):
    from tpurec.cli import main

    args = ["bench", "data", "--rows", "3000", "--convert-rows", "500", "--passes", "1", "--tables", "mlperf-dcnv2"]
    assert main([*args, "--dir", str(tmp_path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["rows"] == 3000 and res["tpurec_samples_per_s"] > 0 and res["torchrec_samples_per_s"] is None
    assert "mlperf-dcnv2 is multi-hot" in res["torchrec_skipped"]
