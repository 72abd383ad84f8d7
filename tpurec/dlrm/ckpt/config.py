"""The model config a checkpoint was written for, compared with a resuming run's at `--resume`.

A checkpoint of another architecture, table set or optimizer fails deep inside DCP (or, worse, loads
into a different dataset's split); refusing first names the field and both values.
"""

from __future__ import annotations

import json
import os

from tpurec.runtime import storage

# Config fields a checkpoint fixes: the model's shape and state (architecture, tables, optimizers)
# and the data it was reading (dataset, split, shuffle). Learning rates, schedule, batch size,
# steps and eval cadence may change on resume.
FIXED_CONFIG = (
    "name",
    "table_set",
    "interaction",
    "embedding_dim",
    "dense_arch",
    "over_arch",
    "multi_hot_sizes",
    "dcn_num_layers",
    "dcn_low_rank_dim",
    "embedding_optimizer",
    "dense_optimizer",
    "synth_rows",
    "seed",
    "eval_fraction",
    "zch",  # not a DLRMConfig field: the trainer adds it (tables behind the managed-collision remap)
    "zch_eviction",  # with --zch only, as the next: the remap's state differs by policy
    "zch_ranks",  # each rank holds its block of the remap: its ids and table sizes follow the world size
    "dense_transform",  # not a DLRMConfig field either: the dense inputs the model was trained on
)


def config_mismatch(path: str | os.PathLike, config: dict) -> str | None:
    """A one-line refusal when checkpoint `path` was written with another value of a FIXED_CONFIG
    field than `config` (a DLRMConfig.to_dict()), naming the field and both values; else None."""
    try:
        saved = json.loads((storage.path(path) / "meta.json").read_text()).get("config") or {}
    except (OSError, json.JSONDecodeError) as e:
        return f"{storage.path(path) / 'meta.json'}: unreadable ({e}); the checkpoint is damaged"
    for name in FIXED_CONFIG:
        if name not in saved:
            continue  # a field added after the checkpoint was written
        theirs, ours = saved[name], json.loads(json.dumps(config.get(name)))  # tuples as JSON lists
        if theirs != ours and name == "zch_ranks":
            return (
                f"{path} was written with --zch at {theirs} rank(s), this run has {ours}: the managed-collision "
                "remap keeps each rank's block of every table (their ids and sizes follow the world size), so it "
                f"resumes only at the world size it was written at (--nproc {theirs}, or start a new run)"
            )
        if theirs != ours and name == "zch":
            return (
                f"{path} was written {'with' if theirs else 'without'} --zch (managed-collision tables), this run "
                f"is {'with' if ours else 'without'}: {'give' if theirs else 'leave out'} --zch, or start a new run"
            )
        if theirs != ours:
            flag = "--model" if name in ("name", "table_set") else "--" + name.replace("_", "-")
            fix = f"leave out {flag}" if theirs is None else f"give {flag} {_show(theirs, flag=True)}"
            return (
                f"{path} was written with {name} = {_show(theirs)} ({flag}), this run has {_show(ours)}: "
                f"a checkpoint resumes only the model and data it was written for ({fix}, or start a new run)"
            )
    return None


def _show(value: object, flag: bool = False) -> str:
    if value is None:
        return "the model's default"
    if isinstance(value, list):
        return ",".join(map(str, value)) if flag else "[" + ", ".join(map(str, value)) + "]"
    return str(value)
