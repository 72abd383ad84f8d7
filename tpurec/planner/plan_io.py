"""Save a torchrec ShardingPlan as JSON and load it back.

torchrec has only a private `_serialize` and no loader, so this is our own versioned schema:

    {"format": "tpurec-sharding-plan", "version": 1,
     "modules": {module_path: {param: {"sharding_type", "compute_kernel", "ranks",
                                       "shards": [{"offsets", "sizes", "placement"}] | null,
                                       "enforce_hbm", "stochastic_rounding", "bounds_check_mode",
                                       "output_dtype", "cache_params"}}},   # cache_params: a host-tier
                                       # table's {"load_factor", "algorithm": "LRU" | "LFU"} (absent: none)
     "meta": {...}}   # free-form: topology, batch size, tables... (used by `tpurec plan show`)

A `tpurec plan --format json` report embeds the same object under "plan", so either file loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpurec import strict_json
from tpurec.errors import UserError
from tpurec.planner.plan_check import module_plans

if TYPE_CHECKING:
    from torchrec.distributed.types import CacheParams, ParameterSharding, ShardingPlan

FORMAT = "tpurec-sharding-plan"
VERSION = 1


def plan_to_dict(plan: ShardingPlan, meta: dict | None = None) -> dict:
    from torchrec.distributed.types import EnumerableShardingSpec

    modules: dict[str, Any] = {}
    for path, module_plan in module_plans(plan).items():
        params = {}
        for name, ps in module_plan.items():
            if ps.key_value_params is not None:
                raise UserError(f"{path}.{name}: key_value_params are not serializable here")
            spec = ps.sharding_spec
            if spec is not None and not isinstance(spec, EnumerableShardingSpec):
                raise UserError(f"{path}.{name}: only EnumerableShardingSpec is supported, got {type(spec).__name__}")
            params[name] = {
                "sharding_type": ps.sharding_type,
                "compute_kernel": ps.compute_kernel,
                "ranks": list(ps.ranks) if ps.ranks is not None else None,
                "shards": None
                if spec is None
                else [
                    {"offsets": list(s.shard_offsets), "sizes": list(s.shard_sizes), "placement": str(s.placement)}
                    for s in spec.shards
                ],
                "enforce_hbm": ps.enforce_hbm,
                "stochastic_rounding": ps.stochastic_rounding,
                "bounds_check_mode": ps.bounds_check_mode.name if ps.bounds_check_mode is not None else None,
                "output_dtype": ps.output_dtype.name if ps.output_dtype is not None else None,
                **({"cache_params": _cache_to_dict(ps.cache_params)} if ps.cache_params is not None else {}),
            }
        modules[path] = params
    out = {"format": FORMAT, "version": VERSION, "modules": modules}
    if meta is not None:
        out["meta"] = meta
    return out


def _cache_to_dict(cache: CacheParams) -> dict:
    """A host-tier table's CacheParams as the plan keeps them: the two fields tpurec reads (the others
    are about FBGEMM's CUDA cache: docs/host_tier.md)."""
    return {
        "load_factor": cache.load_factor,
        "algorithm": cache.algorithm.name if cache.algorithm is not None else None,
    }


def _cache_from_dict(d: dict) -> CacheParams:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
    from torchrec.distributed.types import CacheParams

    algorithm = d.get("algorithm")
    return CacheParams(
        load_factor=d.get("load_factor"), algorithm=CacheAlgorithm[algorithm] if algorithm is not None else None
    )


def _placement(text: str) -> str:
    # ShardMetadata parses "rank:0/tpu:0" itself; torch.device("tpu") only parses once the
    # PrivateUse1 backend is named, which TorchTPU does, and which we do for offline use.
    if "/tpu" in text:
        from tpurec.planner.topology import _enable_offline_tpu

        _enable_offline_tpu()
    return text


def plan_from_dict(doc: dict, source: str = "plan file") -> ShardingPlan:
    """The ShardingPlan of a plan document (or of a report holding one); `source` names it in errors."""
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ModuleShardingPlan, ShardingPlan

    from tpurec.planner.plan_schema import check_modules, obj

    at = "$"
    if _is_report(doc):
        doc, at = doc["plan"], "$.plan"
    try:
        obj(at, doc)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    if doc.get("format") != FORMAT:
        raise UserError(f"{source}: not a tpurec sharding plan (format={doc.get('format')!r})")
    if doc.get("version") != VERSION:
        raise UserError(
            f"{source}: unsupported plan version {doc.get('version')!r}; this tpurec reads version {VERSION}"
        )
    plan: dict[str, ModuleShardingPlan] = {}
    modules = doc.get("modules")
    if not isinstance(modules, dict):
        raise UserError(f"{source} has no 'modules' object")
    try:  # every field's kind first: one line naming it, not a TypeError deep in TorchRec
        check_modules(f"{at}.modules", modules)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    for path, params in modules.items():
        module_plan = EmbeddingModuleShardingPlan()
        for name, p in params.items():
            try:
                module_plan[name] = _parameter_sharding(p)
            except (KeyError, TypeError, ValueError) as e:
                what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                raise UserError(f"{source}, module {path or '<root>'!r}, table {name!r}: {what}") from None
        plan[path] = module_plan
    return ShardingPlan(plan)


def _parameter_sharding(p: dict) -> ParameterSharding:
    """One table's ParameterSharding from its plan-file entry (KeyError / ValueError when malformed)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torch.distributed._shard.metadata import ShardMetadata
    from torchrec.distributed.types import EnumerableShardingSpec, ParameterSharding
    from torchrec.types import DataType

    spec = None
    if p["shards"] is not None:
        spec = EnumerableShardingSpec(
            [
                ShardMetadata(
                    shard_offsets=list(s["offsets"]),
                    shard_sizes=list(s["sizes"]),
                    placement=_placement(s["placement"]),
                )
                for s in p["shards"]
            ]
        )
    return ParameterSharding(
        sharding_type=p["sharding_type"],
        compute_kernel=p["compute_kernel"],
        ranks=list(p["ranks"]) if p["ranks"] is not None else None,
        sharding_spec=spec,
        enforce_hbm=p.get("enforce_hbm"),
        stochastic_rounding=p.get("stochastic_rounding"),
        bounds_check_mode=BoundsCheckMode[p["bounds_check_mode"]] if p.get("bounds_check_mode") else None,
        output_dtype=DataType[p["output_dtype"]] if p.get("output_dtype") else None,
        cache_params=_cache_from_dict(p["cache_params"]) if p.get("cache_params") is not None else None,
    )


def save_plan(plan: ShardingPlan, path: str | os.PathLike, meta: dict | None = None, flag: str | None = None) -> None:
    """Write the plan to `path` whole or not at all (UserError naming `flag` and the path when it cannot)."""
    from tpurec.outputs import write_atomic

    write_atomic(path, strict_json.dumps(plan_to_dict(plan, meta), indent=1) + "\n", flag)


def _is_report(doc: dict) -> bool:
    """A `tpurec plan --format json` report, which holds the plan under "plan"."""
    return "plan" in doc and doc.get("format") != FORMAT


def read_doc(path: str | os.PathLike) -> dict:
    """The plan file's JSON object, its meta and numbers checked (plan_schema.py); UserError naming the file."""
    from tpurec.planner.plan_schema import check_meta, check_numbers, obj

    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not a JSON plan file ({e})") from None
    except RecursionError:  # Python's parser recurses once per level: [[[[... a million deep
        raise UserError(f"{path}: not a tpurec plan (JSON nested deeper than Python's parser can read)") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: not a tpurec plan (a JSON object is expected)")
    try:  # the meta, wherever it sits: the plan's, or a report's and its plan's
        check_meta("$.meta", doc.get("meta"))
        if _is_report(doc):
            check_meta("$.plan.meta", obj("$.plan", doc["plan"]).get("meta"))
        check_numbers(doc, report=_is_report(doc))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    return doc


def load_plan(path: str | os.PathLike, refused_ok: bool = False) -> ShardingPlan:
    """The ShardingPlan saved by save_plan (or embedded in a `tpurec plan --format json` report).

    The report of a refused plan (`fits: false`) holds a placement that does not fit its slice; it
    is refused here unless `refused_ok` (the inspector re-reports it)."""
    doc = read_doc(path)
    refusal = doc.get("refusal") or (doc.get("meta") or {}).get("refusal")
    if refusal and not refused_ok:
        raise UserError(f"{path}: this plan does not fit its slice, so it cannot be applied ({refusal})")
    return plan_from_dict(doc, source=str(path))


def load_meta(path: str | os.PathLike) -> dict:
    doc = read_doc(path)
    if _is_report(doc):
        return doc.get("meta") or doc["plan"].get("meta") or {}
    return doc.get("meta") or {}
