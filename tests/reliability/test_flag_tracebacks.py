"""Flags whose values were tracebacks (#61 item 6), now argparse's one line naming the flag, before any
work: nothing made, nothing trained."""

from __future__ import annotations

import pytest

from tests.reliability.inproc import assert_refused, run_cli


@pytest.mark.parametrize(
    "argv,says",
    [
        (
            ["data", "synth", "--rows", 100, "--out", "{T}/syn", "--compression", "bogus"],
            "tpurec data synth: error: argument --compression: 'bogus' is not a Parquet codec (choose from none, "
            "snappy, gzip, brotli, zstd, lz4)",
        ),
        (
            ["data", "convert", "{T}/in.tsv", "--out", "{T}/syn", "--compression", "bogus"],
            "tpurec data convert: error: argument --compression: 'bogus' is not a Parquet codec",
        ),
        (
            ["data", "synth", "--rows", 100, "--out", "{T}/syn", "--seed", 2**64],
            "tpurec data synth: error: argument --seed: '18446744073709551616' must be in [0, 2^63)",
        ),
        (
            ["train", "--steps", 1, "--seed", 2**64],
            "tpurec train: error: argument --seed: '18446744073709551616' must be in [0, 2^63)",
        ),
        (
            ["train", "--zch", "--zch-eviction-interval", 10**20],
            "tpurec train: error: argument --zch-eviction-interval: '100000000000000000000' must be a whole number of "
            "steps in [1, 2^31-1]",
        ),
        (
            ["train", "--zch-eviction-interval", "1e20"],
            "tpurec train: error: argument --zch-eviction-interval: '1e20' is not a whole number",
        ),
    ],
    ids=["synth_codec", "convert_codec", "synth_seed", "train_seed", "zch_interval_huge", "zch_interval_float"],
)
def test_a_bad_codec_or_seed_is_one_line_and_nothing_is_made(tmp_path, capsys, monkeypatch, argv, says):
    """--compression bogus was pyarrow's traceback, leaving an empty --out; --seed 2^64 was torch's
    "Overflow when unpacking long long" traceback."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "in.tsv").write_text("1\t" + "\t".join(["1"] * 13 + ["a"] * 26) + "\n")
    code, out, err = run_cli([str(a).replace("{T}", str(tmp_path)) for a in argv], capsys)
    assert_refused(code, err, says)
    assert not (tmp_path / "syn").exists() and not (tmp_path / "cache").exists()


def test_a_codec_is_taken_in_any_case():
    from tpurec.argtypes import parquet_codec

    assert [parquet_codec(c) for c in ("ZSTD", "none", "Snappy")] == ["zstd", "none", "snappy"]


@pytest.mark.parametrize(
    "blob,says",
    [
        ("{batch_size: 5", "TPUREC_TRAIN_OPTIONS is not JSON (Expecting property name enclosed in double quotes"),
        ("[1, 2]", "TPUREC_TRAIN_OPTIONS holds list, not a JSON object of `tpurec train`'s options"),
        ('{"batch_szie": 5}', "TPUREC_TRAIN_OPTIONS: unknown option 'batch_szie' (did you mean 'batch_size'?)"),
        ('{"batch_size": "5"}', 'batch_size (--batch-size) is "5"; it takes a whole number or null'),
        ('{"quiet": 1}', "quiet (--quiet) is 1; it takes true or false"),
        ('{"dense_arch": [8, "x"]}', 'dense_arch (--dense-arch) is [8, "x"]; it takes a list of whole numbers or null'),
        ('{"device": "gpu"}', 'device (--device) is "gpu"; it takes one of auto, cpu, tpu'),
    ],
    ids=["not_json", "not_object", "unknown_field", "wrong_type", "not_bool", "bad_list", "not_a_choice"],
)
def test_a_bad_options_variable_is_one_line(capsys, monkeypatch, blob, says):
    """`python -m tpurec.dlrm` (a rank of `tpurec train --nproc`) reads its options from
    TPUREC_TRAIN_OPTIONS: a bad one was json's or the dataclass's traceback (a TypeError for an unknown
    field; a wrong type taken and failing later)."""
    from tpurec.dlrm.__main__ import main

    monkeypatch.setenv("TPUREC_TRAIN_OPTIONS", blob)
    code = main([])
    err = capsys.readouterr().err
    assert_refused(code, err, "tpurec train: error: ")
    assert says in err, err


def test_the_options_variable_takes_what_the_launcher_writes():
    from tpurec.dlrm.options import TrainOptions

    options = TrainOptions(batch_size=64, dense_arch=(8, 4), epochs=1.5, quiet=True, device="cpu")
    assert TrainOptions.from_json(options.to_json()) == options
    assert TrainOptions.from_json(TrainOptions().to_json()) == TrainOptions()
