"""One writer per dataset directory (issue #29, family 9).

Two `data convert` / `data synth` runs into one `--out` both reported success while the dataset
held a mix of their files. The output directory is now locked as checkpoint directories are
(flock on OUT/.lock, `tpurec/runtime/dir_lock.py`): the second run is refused in one line naming the
holder's pid and command, exit 2, and writes nothing.
"""

from __future__ import annotations

import os

import pytest

from tests.reliability.inproc import assert_refused, run_cli
from tests.reliability.racers import WAIT, race


def test_a_second_conversion_into_an_out_being_written_is_refused_naming_the_holder(tmp_path, tsv, capsys):
    from tpurec.data.out_lock import locked_output

    out = tmp_path / "out"
    holder = f"pid {os.getpid()}, tpurec data convert"
    with locked_output(out, overwrite=False, program="tpurec data convert"):  # the first run, mid-write
        code, _, err = run_cli(["data", "convert", tsv, "--out", out, "--quiet", "--jobs", 1], capsys)
        assert_refused(code, err, f"tpurec data: error: --out {out} is being written by another run ({holder})")
        code, _, err = run_cli(["data", "synth", "--rows", 100, "--out", out, "--quiet", "--overwrite"], capsys)
        assert_refused(code, err, f"--out {out} is being written by another run ({holder}); wait for it")
        assert not list(out.glob("*.parquet*"))  # nothing written by the refused runs
    code, out_text, err = run_cli(["data", "convert", tsv, "--out", out, "--quiet", "--jobs", 1], capsys)
    assert code == 0, err  # released with the first run: the next one writes
    assert sorted(p.name for p in out.iterdir()) == ["_dataset.json", "part-00000.parquet"]  # no .lock left


RACER = (
    "from tpurec.cli import main\n"
    + WAIT
    + "sys.exit(main(['data', 'synth', '--rows', '50000', '--row-group-size', '8192', '--out', sys.argv[3], "
    "'--overwrite', '--quiet']))\n"
)


@pytest.mark.slow  # two processes starting Python (about 15 s on a loaded 2-core host); the refusal itself is above
def test_two_real_synth_runs_into_one_out_one_writes_and_the_other_names_it(tmp_path):
    """Two processes released together: one writes the dataset, the other is refused naming it."""
    out = tmp_path / "out"
    procs = race(RACER, [out], tmp_path)
    ended = [(p, *p.communicate(timeout=300)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in ended)
    assert codes == [0, 2], [e for _, _, e in ended]
    (winner, _, _), (loser, _, err) = sorted(ended, key=lambda e: e[0].returncode)
    assert err.strip() == (
        f"tpurec data: error: --out {out} is being written by another run (pid {winner.pid}, tpurec data synth); "
        "wait for it or give another --out"
    )
    assert len(list(out.glob("*.parquet"))) == 1 and not list(out.glob("*.tmp-*"))
