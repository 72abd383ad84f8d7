"""What `tpurec train` checks once, in the launching process, before any rank starts.

A --model-module's features and dense count are checked against the data's columns (the model built
here once, on the meta device), so a mapping that leaves out a feature's column or reads an integer
column as sparse is one line at once, not one from `rank 0` after the ranks built their data. A plan
file and a limits file need only the files and the model's tables, so a plan for another model,
world size or TPU generation, or limits measured for another model, are refused here, in one line,
within seconds, instead of once per rank after each rank built its data and model. On a TPU (real
or emulated) the --model-module's forward also runs once here on 2 samples, for ops TorchTPU lacks
(tpurec/dlrm/forward_preflight.py): one line naming the op and the user's line, not one per rank at
step 1. The checks are
the ones the ranks run (tpurec/planner/plan_check.py, tpurec/planner/id_limits.py), called here too;
the ranks still run theirs (a library user has no launcher).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from tpurec.errors import UserError

if TYPE_CHECKING:
    from tpurec.dlrm.options import TrainOptions
    from tpurec.dlrm.user_model import UserModel


def check_before_launch(
    options: TrainOptions, world_size: int | None, slice_name: str | None, tpu: bool = False
) -> None:
    """Raise UserError (one line naming the file) when a --model-module does not fit --data (its
    features' columns, its dense count, its tables' id ranges) or (`tpu`: the ranks run on a TPU, real
    or emulated) its forward calls an op TorchTPU lacks, or --plan or --limits does not fit the model,
    the world size (None: a real TPU slice's, known only to its ranks) or (an emulated TPU slice) its
    generation."""
    if options.model_module:
        meta = check_model_data(options)
        if tpu:
            from tpurec.dlrm.forward_preflight import check_forward

            check_forward(_user_model(options), meta)
    if not (options.plan or options.id_limits) or world_size is None:
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
    from tpurec.data.catalog import get_table_set
    from tpurec.dlrm.configs import synth_multi_hot
    from tpurec.dlrm.data import data_metadata, model_table_sizes, synth_dir
    from tpurec.dlrm.model import build_model
    from tpurec.planner.plan_check import embedding_tables

    cfg = options.config()
    if options.model_module:  # the user's model, built on its own terms (tpurec.dlrm.user_model)
        return embedding_tables(_user_model(options).module)
    defaults = [t.num_embeddings for t in get_table_set(cfg.table_set).tables]
    data = options.data or synth_dir(cfg.table_set, cfg.synth_rows, cfg.seed, synth_multi_hot(cfg))
    columns = options.column_spec() if options.data else None
    sizes = model_table_sizes(data, defaults, columns)
    meta = data_metadata(data, columns)
    names = [f["name"] for f in meta.get("sparse", [])]
    dense = len(meta.get("dense") or []) or 1  # no dense columns: refused by the trainer, in one line
    return embedding_tables(build_model(cfg, table_sizes=sizes, feature_names=names or None, num_dense=dense))


_LOADED: dict[tuple[str, int], UserModel] = {}  # built once for every check of this process


def _user_model(options: TrainOptions) -> UserModel:
    from tpurec.dlrm.user_model import load

    assert options.model_module
    key = (options.model_module, options.config().seed)
    if key not in _LOADED:
        _LOADED[key] = load(*key)
    return _LOADED[key]


def check_model_data(options: TrainOptions) -> dict:
    """The --model-module's features and dense count against --data's columns (the column mapping
    applied), as each rank checks them once it has built the model (tpurec.dlrm.user_model); returns
    the data's metadata."""
    from tpurec.dlrm.data import data_metadata
    from tpurec.dlrm.user_model import data_table_sizes
    from tpurec.runtime import storage

    assert options.data
    data = storage.path(options.data)
    meta = data_metadata(data, options.column_spec())
    data_table_sizes(_user_model(options), meta, str(data))
    return meta


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
