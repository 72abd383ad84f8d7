"""scripts/tpu_probe_update_copies.py: the table-copy finder on compiled program text, and its smoke run
on CPU (where XLA scatters the donated table in place: no copy in the updates, one in `t + 0`)."""

from __future__ import annotations

from tests.helpers.scripts import load_script


def test_table_copies_finds_copies_of_the_tables_shape_only():
    hlo = "\n".join(
        [
            "  %copy.1 = f32[1000,128]{1,0:T(8,128)} copy(%p0)",
            "  %cs = (f32[1000,128], f32[1000,128]) copy-start(%p0)",
            "  ROOT %copy.2 = f32[1000,128]{1,0} copy(%p0)",
            "  %copy.3 = f32[999,128]{1,0} copy(%p1)",
            "  %s = f32[1000,128]{1,0} scatter(%p0, %i, %u)",
        ]
    )
    script = load_script("tpu_probe_update_copies")
    got = script.table_copies(hlo, 1000, 128)
    assert got == ["%copy.1 = f32[1000,128]{1,0:T(8,128)} copy(%p0)", "ROOT %copy.2 = f32[1000,128]{1,0} copy(%p0)"]
    assert script.table_ops(hlo, 1000, 128) == ["copy", "scatter"]


def test_cpu_smoke_run_finds_the_updates_in_place_and_the_copy_a_copy(tmp_path):
    args = ["--cpu", "--out", str(tmp_path / "uc.json"), "--hlo-dir", str(tmp_path)]
    doc = load_script("tpu_probe_update_copies").main(args)
    (size,) = doc["sizes"]
    progs = size["programs"]
    updates = ("tpurec_sgd", "tpurec_adagrad", "xla_sgd", "touch_one", "xla_sgd_1k")
    assert set(progs) == {*updates, "table_copy"}
    assert all(progs[k]["table_copies"] == [] for k in updates)
    assert all(progs[k]["donated_inputs_deleted"] is True for k in updates)
    assert progs["table_copy"]["donated_inputs_deleted"] is None and progs["table_copy"]["table_ops"] != []
    # the first size's programs, to read (not the copy's)
    assert sorted(p.name for p in tmp_path.glob("hlo_*.txt")) == sorted(f"hlo_{k}.txt" for k in updates)
    assert len(progs["table_copy"]["table_copies"]) == 1
    assert "(0, {}, may-alias)" in progs["tpurec_sgd"]["aliases"] and progs["table_copy"]["aliases"] is None
    assert min(p["ms"] for p in progs.values()) > 0
