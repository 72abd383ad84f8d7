"""Every output of every command is checked before any work (issue #29, family 4).

An unwritable `--metrics-out` or `--save-plan`, or TPUREC_CACHE pointing at a file, used to fail
with a traceback after training. Each case here is refused in one line naming the flag (or
variable) and the path, exit 2, before any work: no synthetic data made, nothing planned or
converted. In-process runs; "under a file" stands for any path that cannot be created.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.inproc import assert_refused, run_cli

TRAIN = ["train", "--quiet", "--synth-rows", 3000, "--steps", 1, "--eval-every", 0]


@pytest.fixture
def a_file(tmp_path) -> Path:
    f = tmp_path / "a-file"
    f.write_text("not a directory\n")
    return f


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    """A TPUREC_CACHE with nothing in it: a run that starts work makes the synthetic data here."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TPUREC_CACHE", str(cache))
    return cache


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


# (flags given to `tpurec train`, given the file F and tmp_path T; what the one line says)
TRAIN_OUTPUTS = [
    (lambda f, t: ["--metrics-out", f / "m.csv"], lambda f, t: f"--metrics-out {f / 'm.csv'}: {f} is not a directory"),
    (lambda f, t: ["--save-plan", t], lambda f, t: f"--save-plan {t}: {t} is a directory"),
    (lambda f, t: ["--save-plan", f / "p.json"], lambda f, t: f"--save-plan {f / 'p.json'}: {f} is not a directory"),
    (
        lambda f, t: ["--limits-out", t / "no" / "l.json"],
        lambda f, t: f"--limits-out {t / 'no' / 'l.json'}: cannot write into {t / 'no'}: no such directory",
    ),
    (lambda f, t: ["--curves-out", f / "c.png"], lambda f, t: f"--curves-out {f / 'c.png'}: {f} is not a directory"),
    (
        lambda f, t: ["--checkpoint-dir", t / "ck", "--curves-out", _mkdir(t / "c.png")],
        lambda f, t: f"--curves-out {t / 'c.png'}: {t / 'c.png'} is a directory",
    ),
]


@pytest.mark.parametrize(
    "flags,says", TRAIN_OUTPUTS, ids=["metrics", "plan_dir", "plan_under_file", "limits", "curves", "curves_dir"]
)
def test_train_refuses_an_output_it_cannot_write_before_any_work(a_file, tmp_path, empty_cache, capsys, flags, says):
    code, out, err = run_cli([*TRAIN, *flags(a_file, tmp_path)], capsys)
    assert_refused(code, err, f"tpurec train: error: {says(a_file, tmp_path)}")
    assert out == "" and not empty_cache.exists()  # no synthetic data made, nothing trained


def test_train_refuses_a_read_only_metrics_dir(unwritable_dir, empty_cache, capsys):
    d, reason = unwritable_dir
    code, _, err = run_cli([*TRAIN, "--metrics-out", d / "m.jsonl"], capsys)
    assert_refused(code, err, f"tpurec train: error: --metrics-out {d / 'm.jsonl'}: cannot write in {d} ({reason})")
    assert not empty_cache.exists()


def test_train_refuses_tpurec_cache_pointing_at_a_file(a_file, monkeypatch, capsys):
    monkeypatch.setenv("TPUREC_CACHE", str(a_file))
    code, _, err = run_cli(TRAIN, capsys)  # the synthetic data (and the curves) would go there
    assert_refused(code, err, f"tpurec train: error: TPUREC_CACHE={a_file}: {a_file} is not a directory")
    code, _, err = run_cli([*TRAIN, "--curves-out", "none"], capsys)  # the data alone needs it too
    assert_refused(code, err, f"TPUREC_CACHE={a_file}: {a_file} is not a directory")


def test_train_reads_a_cached_dataset_from_a_read_only_cache(tiny_cache, trained, monkeypatch, capsys):
    """The cache is written only when the data is not there yet (a shared read-only cache works)."""
    from tpurec import outputs
    from tpurec.dlrm.options import TrainOptions

    monkeypatch.setenv("TPUREC_CACHE", str(tiny_cache))  # holds the 3,000-row dataset (`trained` made it)
    checked = outputs.output_problem

    def output_problem(flag, path, kind="file"):
        assert flag != "TPUREC_CACHE", "the cache was checked for writing, though nothing is written there"
        return checked(flag, path, kind)

    monkeypatch.setattr(outputs, "output_problem", output_problem)
    assert TrainOptions(synth_rows=3000, curves_out="none").check() is None


@pytest.mark.parametrize("show", [False, True], ids=["plan", "plan_show"])
def test_plan_refuses_an_out_it_cannot_write_before_planning(a_file, tmp_path, capsys, show):
    plan = tmp_path / "p.json"
    if show:
        base = ["plan", "--model", "dlrm-tiny", "--topology", "v6e-4", "--format", "json", "--out", plan]
        assert run_cli(base, capsys)[0] == 0
    argv = ["plan", "show", plan] if show else ["plan", "--model", "criteo-kaggle", "--topology", "v5p-128"]
    code, out, err = run_cli([*argv, "--format", "html", "--out", a_file / "p.html"], capsys)
    assert_refused(code, err, f"tpurec plan: --out {a_file / 'p.html'}: {a_file} is not a directory")
    assert out == ""


def test_plan_png_refuses_its_default_out_in_a_read_only_cwd(unwritable_dir, monkeypatch, capsys):
    d, reason = unwritable_dir
    monkeypatch.chdir(d)
    code, _, err = run_cli(["plan", "--model", "dlrm-tiny", "--topology", "v6e-4", "--format", "png"], capsys)
    assert_refused(code, err, f"tpurec plan: --out plan.png: cannot write in {d} ({reason})")


def test_data_convert_and_synth_refuse_an_out_under_a_file(a_file, tsv, capsys):
    out = a_file / "data"
    code, _, err = run_cli(["data", "convert", tsv, "--out", out, "--jobs", 2, "--quiet"], capsys)
    assert_refused(code, err, f"tpurec data: error: --out {out}: {a_file} is not a directory")
    code, _, err = run_cli(["data", "synth", "--rows", 100, "--out", out, "--quiet"], capsys)
    assert_refused(code, err, f"tpurec data: error: --out {out}: {a_file} is not a directory")


def test_data_stats_refuses_a_read_only_out_before_the_pass(unwritable_dir, tmp_path, capsys, monkeypatch):
    from tpurec.data.synth import synthesize

    synthesize(300, str(tmp_path / "data"), seed=0, show_progress=False)
    d, reason = unwritable_dir

    def no_pass(*a, **k):
        raise AssertionError("the pass started before --out was checked")

    monkeypatch.setattr("tpurec.planner.id_limits.DemandTally", no_pass)
    argv = ["data", "stats", tmp_path / "data", "--model", "dlrm-tiny", "--topology", "v5p-8", "--out", d / "l.json"]
    code, _, err = run_cli(argv, capsys)
    assert_refused(code, err, f"tpurec data: error: --out {d / 'l.json'}: cannot write in {d} ({reason})")


BENCH = [
    (
        ["bench", "data", "--rows", 1000, "--dir", "{F}/work"],
        "tpurec bench data: error: --dir {F}/work: {F} is not a directory",
    ),
    (["bench", "pipeline", "--quick", "--dir", "{F}/work"], "tpurec bench pipeline: error: --dir {F}/work: {F} is not"),
    (["bench", "train", "--steps", 1], "tpurec bench train: error: TPUREC_CACHE={F}: {F} is not a directory"),
]


@pytest.mark.parametrize("argv,says", BENCH, ids=["data", "pipeline", "train"])
def test_bench_refuses_a_work_dir_or_cache_it_cannot_write(a_file, monkeypatch, capsys, argv, says):
    monkeypatch.setenv("TPUREC_CACHE", str(a_file))
    code, out, err = run_cli([str(a).replace("{F}", str(a_file)) for a in argv], capsys)
    assert_refused(code, err, says.replace("{F}", str(a_file)))
    assert not out or json.loads(out) is None


URI_SAYS = "a s3:// URI; this file is written to a local path only (it would land in a local directory 's3:')"


@pytest.mark.parametrize(
    "argv,line",
    [
        (TRAIN + ["--metrics-out", "s3://b/m.csv"], "tpurec train: error: --metrics-out s3://b/m.csv: "),
        (TRAIN + ["--save-plan", "s3://b/p.json"], "tpurec train: error: --save-plan s3://b/p.json: "),
        (["plan", "--model", "dlrm-tiny", "--topology", "v6e-4", "--out", "s3://b/p.txt"], "tpurec plan: --out s3"),
        (
            ["data", "stats", "D", "--model", "dlrm-tiny", "--topology", "v5p-8", "--out", "s3://b/l.json"],
            "tpurec data",
        ),
    ],
    ids=["metrics", "save_plan", "plan_out", "stats_out"],
)
def test_a_file_output_given_as_a_uri_is_refused_not_written_to_a_local_s3_dir(
    tmp_path, empty_cache, capsys, monkeypatch, argv, line
):
    """`s3://b/m.csv` used to land in `./s3:/b/m.csv` while the command printed `wrote s3://b/m.csv`."""
    from tpurec.data.synth import synthesize

    monkeypatch.chdir(tmp_path)
    if "stats" in argv:
        synthesize(300, str(tmp_path / "D"), seed=0, show_progress=False)
    code, out, err = run_cli(argv, capsys)
    assert_refused(code, err, line)
    assert err.strip().endswith(f"{URI_SAYS}: write it locally and copy it to the bucket"), err
    assert not (tmp_path / "s3:").exists() and not empty_cache.exists()


def test_write_atomic_refuses_a_uri(tmp_path, monkeypatch):
    from tpurec.errors import UserError
    from tpurec.outputs import write_atomic

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        write_atomic("gs://b/x.json", "{}", "--out")
    assert str(e.value) == (
        "--out gs://b/x.json: a gs:// URI; this file is written to a local path only (it would land in a local "
        "directory 'gs:'): write it locally and copy it to the bucket"
    )
    assert list(tmp_path.iterdir()) == []
