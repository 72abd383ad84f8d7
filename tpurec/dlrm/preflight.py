"""What `tpurec train` checks once, in the launching process, before any rank starts.

A plan file and a limits file need only the files and the model's tables, so a plan for another model,
world size or TPU generation, or limits measured for another model, are refused here, in one line,
within seconds, instead of once per rank after each rank built its data and model. The checks are
the ones the ranks run (tpurec/planner/plan_check.py, tpurec/planner/id_limits.py), called here too;
the ranks still run theirs (a library user has no launcher).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from tpurec.errors import UserError

if TYPE_CHECKING:
    from tpurec.dlrm.options import TrainOptions


def check_before_launch(options: TrainOptions, world_size: int, slice_name: str | None) -> None:
    """Raise UserError (one line naming the file) when --plan or --limits does not fit the model,
    the world size or (an emulated TPU slice) its generation."""
    if not (options.plan or options.id_limits):
        return
    tables = model_tables(options)
    if options.plan:
        check_plan_file(options.plan, tables, world_size, slice_name)
    if options.id_limits:
        from tpurec.planner.id_limits import check_limits_tables, load_limits

        # the layout (devices, SparseCores, batch) is the ranks' to check: a small dataset caps the batch
        check_limits_tables(load_limits(options.id_limits), tables, f"--limits {options.id_limits}")


def model_tables(options: TrainOptions) -> dict[str, dict[str, tuple[int, int]]]:
    """{module path: {table: (rows, dim)}} of the model the ranks will build (a meta-device model:
    no table is allocated), with the table sizes and feature names of the data they will read."""
    from tpurec.catalog import get_table_set
    from tpurec.dlrm.configs import synth_multi_hot
    from tpurec.dlrm.data import data_metadata, model_table_sizes, synth_dir
    from tpurec.dlrm.model import build_model
    from tpurec.planner.plan_check import embedding_tables

    cfg = options.config()
    if options.model_module:  # the user's model, built on its own terms (tpurec.dlrm.user_model)
        from tpurec.dlrm.user_model import load

        return embedding_tables(load(options.model_module, cfg.seed).module)
    defaults = [t.num_embeddings for t in get_table_set(cfg.table_set).tables]
    data = options.data or synth_dir(cfg.table_set, cfg.synth_rows, cfg.seed, synth_multi_hot(cfg))
    columns = options.column_spec() if options.data else None
    sizes = model_table_sizes(data, defaults, columns)
    meta = data_metadata(data, columns)
    names = [f["name"] for f in meta.get("sparse", [])]
    dense = len(meta.get("dense") or []) or 1  # no dense columns: refused by the trainer, in one line
    return embedding_tables(build_model(cfg, table_sizes=sizes, feature_names=names or None, num_dense=dense))


def check_plan_file(
    path: str, tables: Mapping[str, Mapping[str, tuple[int, int]]], world_size: int, slice_name: str | None
) -> None:
    """The plan at `path` against the model's tables and the world size (plan_check), and, for an
    emulated TPU slice, against its TPU generation (the SparseCores per device it was planned for)."""
    from tpurec.planner.plan_check import PlanMismatchError, align_to_model_tables, check_plan, check_plan_world
    from tpurec.planner.plan_io import load_meta, load_plan, read_doc

    source = f"--plan {path}"
    try:
        plan = align_to_model_tables(load_plan(path), tables)
        check_plan(plan, tables, world_size)
    except PlanMismatchError as e:
        raise e.named(source) from None
    planned = load_meta(path).get("topology")
    if slice_name and isinstance(planned, str) and not planned.lower().startswith("cpu"):
        _check_generation(source, planned, slice_name)
    check_plan_world(read_doc(path), world_size, source)  # after the generation: its line says more


def _check_generation(source: str, planned: str, slice_name: str) -> None:
    from tpurec.planner.topology import parse_slice

    try:
        theirs = parse_slice(planned)
    except UserError:
        return  # a topology name tpurec does not know: the shards were checked
    ours = parse_slice(slice_name)
    if theirs.generation.name != ours.generation.name:
        raise UserError(
            f"{source} was planned for {theirs.name} ({theirs.generation.name}), not {ours.name} "
            f"({ours.generation.name}): plan for the slice you run (tpurec plan --topology {ours.name})"
        )
