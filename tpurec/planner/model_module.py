"""`tpurec plan --model-module pkg.mod:fn`: plan the user's own model.

`fn()` returns the model (an nn.Module holding EmbeddingBagCollections and/or EmbeddingCollections,
best built on the meta device so nothing is allocated), or `(model, constraints)` with TorchRec ParameterConstraints by
table name, exactly what `tpurec.DistributedModelParallel(model, constraints=...)` takes. The model
is then planned by `planner.plan`, the function DMP calls, with the same optimizer inference
(apply_optimizer_in_backward / fused_params).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from tpurec.data.catalog import TableSpec
from tpurec.errors import UserError

if TYPE_CHECKING:
    from torch import nn
    from torchrec.distributed.planner.types import ParameterConstraints


def parse_target(target: str) -> tuple[str, str]:
    """('pkg.mod', 'fn') from 'pkg.mod:fn', or ('dir/file.py', 'fn') from a file's path, refused in
    one line unless the module or file is there (checked before torch loads: a typo is told in a
    second, not after the 20 s torch and TorchRec take to import)."""
    module_name, _, fn_name = target.partition(":")
    if not module_name or not fn_name.isidentifier():
        raise UserError(f"--model-module {target!r}: expected MODULE:FUNCTION, e.g. my_pkg.models:build")
    if _is_path(module_name):
        if not os.path.isfile(module_name):
            raise UserError(f"--model-module {target!r}: no file {module_name!r}")
        return module_name, fn_name
    try:
        with _on_path_for_now(os.getcwd()):
            found = importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):  # a parent package missing, or a relative name
        found = False
    if not found:
        raise UserError(
            f"--model-module {target!r}: no module {module_name!r} in {os.getcwd()} or on PYTHONPATH "
            "(or give the file's path, e.g. ./my_model.py:build)"
        )
    return module_name, fn_name


def _is_path(module_name: str) -> bool:
    """A file's path rather than a module's dotted name: ./m.py, dir/m.py, m.py."""
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


@contextlib.contextmanager
def _on_path_for_now(directory: str) -> Iterator[None]:
    """`directory` at the END of sys.path while the user's module imports, then gone again.

    The user's package is found there (as `python -m` would find it), but it never shadows an
    installed or standard module: a `yaml.py` or `matplotlib.py` left in the working directory must
    not run in place of the real one, now or when tpurec imports it later (#61)."""
    directory = os.path.abspath(directory)
    present = any(os.path.abspath(p or os.curdir) == directory for p in sys.path)
    if not present:
        sys.path.append(directory)
    try:
        yield
    finally:
        if not present and directory in sys.path:
            sys.path.remove(directory)
        importlib.invalidate_caches()


def _import(module_name: str) -> ModuleType:
    """The module of a dotted name (found with the working directory appended to sys.path, for this
    import only), or of a file's path (imported under its file's stem; sys.path untouched: the file
    is found by its path, and its own imports come from PYTHONPATH and the installed packages)."""
    if not _is_path(module_name):
        with _on_path_for_now(os.getcwd()):
            return importlib.import_module(module_name)
    name = os.path.splitext(os.path.basename(module_name))[0]
    spec = importlib.util.spec_from_file_location(name, module_name)
    if spec is None or spec.loader is None:
        raise ImportError(f"{module_name} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    spec.loader.exec_module(module)
    return module


def library_frame(filename: str) -> bool:
    """A frame of tpurec, the standard library or an installed package (not the user's code)."""
    ours = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
    libs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    return (
        filename.startswith("<")
        or os.path.realpath(filename).startswith((ours, *(p + os.sep for p in libs)))
        or "site-packages" in filename
    )


def raised_by_user_code(error: BaseException) -> bool:
    """Whether the innermost frame of `error`'s traceback outside the standard library and the
    installed packages is the user's (not tpurec's: an exception out of tpurec is a bug, kept whole)."""
    import traceback

    ours = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
    for f in reversed(traceback.extract_tb(error.__traceback__)):
        if os.path.realpath(f.filename).startswith(ours):
            return False
        if not library_frame(f.filename):
            return True
    return False


def user_code_failed(target: str, what: str, error: BaseException, hint: str = "") -> UserError:
    """One line for an exception out of the user's module: what raised it, and where (the innermost
    frame outside tpurec, the standard library and the installed packages; the exception stays chained);
    `hint` (how tpurec called it) follows in parentheses."""
    import traceback

    theirs = [f for f in traceback.extract_tb(error.__traceback__) if not library_frame(f.filename)]
    where = theirs[-1] if theirs else None  # none: it failed calling in (a missing argument)
    at = f" at {where.filename}:{where.lineno}" if where is not None else ""
    said = (str(error).strip().splitlines() or [""])[0]
    said = f"{type(error).__name__}: {said}" if said else type(error).__name__
    return UserError(f"--model-module {target!r}: {what} raised {said}{at}" + (f" ({hint})" if hint else ""))


def load_model(target: str) -> tuple[nn.Module, dict[str, ParameterConstraints] | None]:
    """(model, constraints or None) from 'pkg.mod:fn'; a UserError naming what is wrong otherwise."""
    module_name, fn_name = parse_target(target)
    try:
        module = _import(module_name)
    except ImportError as e:
        raise UserError(f"--model-module {target!r}: cannot import {module_name!r} ({e})") from None
    except Exception as e:  # the module's own code failed: named where, not a traceback through tpurec
        raise user_code_failed(target, f"importing {module_name}", e) from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"--model-module {target!r}: {module_name} has no function {fn_name!r}")
    try:
        built = fn()
    except Exception as e:
        raise user_code_failed(target, f"{fn_name}()", e) from e
    model, constraints = built if isinstance(built, tuple) and len(built) == 2 else (built, None)
    from torch import nn

    if not isinstance(model, nn.Module):
        raise UserError(
            f"--model-module {target!r}: {fn_name}() returned {type(model).__name__}, not an nn.Module "
            "(or a (model, constraints) pair)"
        )
    if constraints is not None and not isinstance(constraints, dict):
        raise UserError(f"--model-module {target!r}: constraints must be a dict by table name")
    if not model_tables(model, constraints):
        raise UserError(
            f"--model-module {target!r}: the model holds no EmbeddingBagCollection or EmbeddingCollection to plan"
        )
    return model, constraints


def model_tables(model: nn.Module, constraints: dict[str, ParameterConstraints] | None = None) -> list[TableSpec]:
    """A TableSpec per table of every EmbeddingBagCollection and EmbeddingCollection in `model`, as
    DMP shards them (pooling factors from the constraints, else 1 id per feature, as the planner
    assumes; an EmbeddingCollection's tables are sequence tables, pooling "none")."""
    from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    out = []
    for m in model.modules():
        configs: Sequence[BaseEmbeddingConfig]
        if isinstance(m, EmbeddingBagCollection):
            configs, weighted = m.embedding_bag_configs(), m.is_weighted()
        elif isinstance(m, EmbeddingCollection):
            configs, weighted = m.embedding_configs(), False
        else:
            continue
        for c in configs:
            factors = getattr((constraints or {}).get(c.name), "pooling_factors", None) or [1.0] * len(c.feature_names)
            out.append(
                TableSpec(
                    c.name,
                    c.feature_names[0],
                    c.num_embeddings,
                    c.embedding_dim,
                    float(sum(factors)),
                    c.data_type.name.lower(),
                    extra_features=tuple(c.feature_names[1:]),
                    pooling=c.pooling.name.lower() if isinstance(c, EmbeddingBagConfig) else "none",
                    weighted=weighted,
                )
            )
    names = [t.name for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"table name(s) {dup} appear in more than one embedding collection; a plan keys tables by name")
    return out


@dataclass(frozen=True)
class ModelFeature:
    """One sparse feature of a user's model: the data column of its name feeds it (docs/your_model.md)."""

    name: str
    table: str
    rows: int  # the table's num_embeddings: the feature's ids are in [0, rows)
    ids_per_sample: int  # its pooling factor (the constraints' pooling_factors), rounded, >= 1
    # A managed-collision table's remap input range (its module's input_size()): the feature's ids go
    # to the remap unhashed, in [0, remap_range); None: an ordinary table, ids hashed into its rows.
    remap_range: int | None = None


UNBOUNDED_REMAP = 2**63  # a remap that states no input range (HashZch's 0) takes any int64 id >= 0


def remap_ranges(model: nn.Module) -> dict[str, int]:
    """{table: its remap's input range} for every table behind a managed-collision module of `model`
    (TorchRec's ManagedCollisionCollection, e.g. inside a ManagedCollisionEmbeddingBagCollection)."""
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    out: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, ManagedCollisionCollection):
            for table, mcm in m._managed_collision_modules.items():
                size = int(cast(Any, mcm).input_size())
                out[table] = size if size > 0 else UNBOUNDED_REMAP
    return out


def unspread_remaps(model: nn.Module, world_size: int) -> list[str]:
    """A line per managed-collision table whose raw ids all land on one rank at `world_size` ranks:
    TorchRec's row-wise remap sends an id to the rank owning its block of [0, input_hash_size), so an
    MCH module of TorchRec's default range (2**63 - 1, as docs/managed_collision.md's example once had)
    and no input_hash_func to spread the ids puts every id below a block's size (all 32-bit ids) in
    rank 0's block: one rank's slots fill and evict while the others stay empty."""
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

    if world_size < 2:
        return []
    out = []
    for m in model.modules():
        if not isinstance(m, ManagedCollisionCollection):
            continue
        for table, mcm in m._managed_collision_modules.items():
            if not isinstance(mcm, MCHManagedCollisionModule) or mcm._input_hash_func is not None:
                continue
            block = -(-int(mcm.input_size()) // world_size)
            if mcm.input_size() >= 2**62:  # a range sized to the ids (2**40 for 40-bit ids) spreads them
                out.append(
                    f"managed-collision table {table!r}: its remap's input range [0, {mcm.input_size():,}) is cut into "
                    f"{world_size} row-wise blocks of {block:,} ids, one per rank, and it has no input_hash_func: "
                    f"every id below {block:,} (all 32-bit ids) goes to rank 0's block; give its "
                    "MCHManagedCollisionModule input_hash_func=tpurec.dlrm.zch.spread_ids, or an input_hash_size "
                    "near the ids' own range (docs/managed_collision.md)"
                )
    return out


def model_features(model: nn.Module, constraints: dict[str, ParameterConstraints] | None = None) -> list[ModelFeature]:
    """Every feature of the model's embedding tables, in table order, each once: what its data holds
    (a column per feature). A feature two tables read must have the same rows in both (one column
    indexes them)."""
    from torchrec.modules.embedding_configs import BaseEmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    out: dict[str, ModelFeature] = {}
    ranges = remap_ranges(model)
    for m in model.modules():
        configs: Sequence[BaseEmbeddingConfig]
        if isinstance(m, EmbeddingBagCollection):
            configs = m.embedding_bag_configs()
        elif isinstance(m, EmbeddingCollection):
            configs = m.embedding_configs()
        else:
            continue
        for c in configs:
            factors = getattr((constraints or {}).get(c.name), "pooling_factors", None) or []
            for i, name in enumerate(c.feature_names):
                hots = max(1, round(float(factors[i]))) if i < len(factors) else 1
                feature = ModelFeature(name, c.name, int(c.num_embeddings), hots, ranges.get(c.name))
                seen = out.setdefault(name, feature)
                if seen.remap_range != feature.remap_range:
                    raise UserError(
                        f"feature {name!r} indexes table {seen.table!r} ({_fed(seen)}) and {c.name!r} "
                        f"({_fed(feature)}): one data column cannot feed both; give both tables one kind of input"
                    )
                if seen.rows != feature.rows:
                    raise UserError(
                        f"feature {name!r} indexes table {seen.table!r} ({seen.rows:,} rows) and {c.name!r} "
                        f"({feature.rows:,} rows): one data column cannot hold ids for both; give the tables one size"
                    )
    return list(out.values())


def _fed(feature: ModelFeature) -> str:
    if feature.remap_range is None:
        return "ids hashed into its rows"
    return f"raw ids below {feature.remap_range:,} for its managed-collision remap"


def dense_in_features(model: nn.Module) -> int | None:
    """How many dense features the model takes: its `dense_in_features` attribute (the name of
    TorchRec's DLRM argument), else, for TorchRec's DLRM (and DLRM_DCN, DLRMTrain around them), the
    input width of its dense arch's first Linear; None when the model does not say."""
    from torch import nn
    from torchrec.models.dlrm import DLRM

    given = getattr(model, "dense_in_features", None)
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    inner = getattr(model, "model", None)
    dlrm = model if isinstance(model, DLRM) else inner if isinstance(inner, DLRM) else None
    if dlrm is None:
        return None
    first = next((m for m in dlrm.dense_arch.modules() if isinstance(m, nn.Linear)), None)
    return None if first is None else int(first.in_features)
