"""`tpurec plan --tables FILE`: a bad entry is one line naming the file, the table and the field."""

from __future__ import annotations

import pytest

from .test_inspect import _cli

GOOD = '{"name": "x", "num_embeddings": 5000, "embedding_dim": 32}'


@pytest.mark.parametrize(
    "entry,message",
    [
        ('{"name": "x", "rows": 0, "dim": 8}', "table #0 ('x'): num_embeddings 0 must be in [1, 1,099,511,627,776]"),
        ('{"name": "x", "rows": -5, "dim": 8}', "num_embeddings -5 must be in [1,"),
        ('{"name": "x", "rows": 1e20, "dim": 8}', "num_embeddings 1e+20 must be in [1,"),
        ('{"name": "x", "rows": "abc", "dim": 8}', "num_embeddings 'abc' is not a whole number"),
        ('{"name": "x", "rows": 10.5, "dim": 8}', "num_embeddings 10.5 is not a whole number"),
        ('{"name": "x", "rows": 10, "dim": 8, "poolng": 3}', "unknown field(s) ['poolng']; known:"),
        (
            '{"name": "x", "rows": 10, "dim": 8, "pooling_factor": -1}',
            "pooling_factor -1.0 must be a finite number > 0",
        ),
        ('{"name": "x", "rows": 10}', "table #0 ('x'): needs 'embedding_dim' (or 'dim')"),
        ('{"rows": 10, "dim": 8}', "table #0: needs a 'name'"),
        ('"x"', "table #0 is str, expected an object"),
    ],
)
def test_bad_table_entry_is_named(tmp_path, capsys, entry, message):
    path = tmp_path / "t.json"
    path.write_text(f"[{entry}]")
    assert _cli("--tables", str(path), "--topology", "v6e-4") == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_truncated_and_duplicate_tables_files(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(f"[{GOOD}, {GOOD[:20]}")
    assert _cli("--tables", str(path), "--topology", "v6e-4") == 2
    assert f"{path}: not a valid tables file (JSONDecodeError" in capsys.readouterr().err
    path.write_text(f"[{GOOD}, {GOOD}]")
    assert _cli("--tables", str(path), "--topology", "v6e-4") == 2
    assert "table #1: name 'x' is used twice" in capsys.readouterr().err
    yaml_path = tmp_path / "t.yaml"
    yaml_path.write_text("tables:\n  - {name: x, rows: [1\n")
    assert _cli("--tables", str(yaml_path), "--topology", "v6e-4") == 2
    assert f"{yaml_path}: not a valid tables file" in capsys.readouterr().err
