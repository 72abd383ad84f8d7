"""The plan's TensorCore pooling per stack (v5e, v4): the Pallas pooling with the most output copies
(up to pool_vmem.ACCUMULATORS) that fit the chip's VMEM (the kernel's own rule), else XLA's segment
sum; none on SparseCore chips."""

from __future__ import annotations

from tpurec.data.catalog import TableSpec
from tpurec.embedding import pool_vmem
from tpurec.planner.report import plan_tables
from tpurec.planner.report_text import format_text
from tpurec.planner.tensorcore_pooling import VMEM_BYTES, pooling_per_stack


def _t(name: str, rows: int, dim: int, features: int = 1, pooling: str = "sum") -> TableSpec:
    extra = tuple(f"{name}_f{i}" for i in range(1, features))
    return TableSpec(name, f"{name}_f0", rows, dim, 2.0 * features, extra_features=extra, pooling=pooling)


def test_a_stack_gets_the_pallas_pooling_while_its_output_fits_vmem():
    # dim 128 at 16,384 samples: one feature with four copies needs ~41 MiB (fits 96 of v5e's 128
    # MiB); three features: four copies ~120 MiB, two ~72 MiB; eight features: not one (~129 MiB)
    small = pooling_per_stack([_t("a", 1000, 128)], "v5e", 16384)
    assert small == [
        {
            "stack": "stack_d128",
            "tables": ["a"],
            "segments": 16384,
            "width": 128,
            "pooling": "pallas",
            "accumulators": 4,
            "vmem_bytes": pool_vmem.vmem_bytes(16384, 128, accumulators=4),
            "vmem_capacity_bytes": 128 << 20,
        }
    ]
    assert small[0]["vmem_bytes"] == (5 * 16392 + 2 * 1024) * 128 * 4
    (three,) = pooling_per_stack([_t("a", 1000, 128, features=3)], "v5e", 16384)
    assert (three["pooling"], three["accumulators"]) == ("pallas", 2)
    assert three["vmem_bytes"] == (3 * 49160 + 2 * 1024) * 128 * 4
    (wide,) = pooling_per_stack([_t("a", 1000, 128, features=4), _t("b", 1000, 128, features=4)], "v5e", 16384)
    assert wide["segments"] == 8 * 16384 and wide["tables"] == ["a", "b"]
    assert (wide["pooling"], wide["accumulators"]) == ("xla", 0)
    assert wide["vmem_bytes"] > VMEM_BYTES["v5e"] * 3 // 4
    # v4's 16 MiB a core: the same small stack falls to XLA's
    assert pooling_per_stack([_t("a", 1000, 128)], "v4", 16384)[0]["pooling"] == "xla"


def test_stacks_are_cut_per_dim_and_sequence_tables_have_no_pooling():
    got = pooling_per_stack([_t("a", 10, 16), _t("b", 10, 64), _t("s", 10, 16, pooling="none")], "v5e", 64)
    assert [(s["stack"], s["tables"], s["width"]) for s in got] == [("stack_d16", ["a"], 16), ("stack_d64", ["b"], 64)]
    # a narrow row takes a whole 128-lane tile in VMEM, as the kernel counts it
    assert got[0]["vmem_bytes"] == got[1]["vmem_bytes"] == pool_vmem.vmem_bytes(64, 128, accumulators=4)


def test_sparsecore_chips_and_cpus_have_no_tensorcore_pooling():
    assert pooling_per_stack([_t("a", 10, 16)], "v5p", 64) is None
    assert pooling_per_stack([_t("a", 10, 16)], "v6e", 64) is None
    assert pooling_per_stack([_t("a", 10, 16)], "cpu", 64) is None


def test_the_plan_report_records_the_pooling_and_its_text_shows_it():
    tables = [_t("a", 1000, 128), _t("b", 1000, 128, features=8)]
    v5e = plan_tables(tables, "v5e-1", batch_size=16384, optimizer="sgd")
    assert [(s["stack"], s["pooling"], s["segments"]) for s in v5e["tensorcore_pooling"]] == [
        ("stack_d128", "xla", 9 * 16384)
    ]
    text = format_text(v5e)
    assert "TensorCore pooling per stack" in text and "147,456 segments x 128  xla" in text
    one = format_text(plan_tables(tables[:1], "v5e-1", batch_size=16384, optimizer="sgd"))
    assert "16,384 segments x 128  pallas x4" in one
    v5p = plan_tables(tables, "v5p-8", batch_size=16384, optimizer="sgd")
    assert v5p["tensorcore_pooling"] is None and "TensorCore pooling" not in format_text(v5p)
