"""What one `tpurec train` run is asked to do: the `TrainOptions` dataclass, whose fields are the flags.

Each field is one flag of `tpurec train` (and of `python -m tpurec.dlrm`), in the order `--help`
lists them. Run settings (data, device, checkpoints, outputs) carry their help here; the config
overrides (`--batch-size`, `--embedding-lr`, ...) take theirs from the matching `DLRMConfig`
field and default to None, meaning "the model's". `config()` applies them to the named config.

The options are plain JSON values, so the `--nproc` launcher hands the resolved options to its
ranks as JSON in the TPUREC_TRAIN_OPTIONS environment variable instead of rebuilding a command line.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from tpurec import strict_json
from tpurec.argtypes import nonnegative_float, nonnegative_int, positive_float, positive_int, step_interval
from tpurec.data.catalog import DEFAULT_TRAIN_MODEL, MODEL_NAMES
from tpurec.dlrm import flags
from tpurec.dlrm.configs import DLRMConfig, get_config, override
from tpurec.dlrm.flags import flag
from tpurec.dlrm.zch import DEFAULT_EVICTION_INTERVAL, POLICIES, RAW_IDS_FIX, ZchSpec
from tpurec.dlrm.zch import data_problem as zch_data_problem
from tpurec.errors import UserError
from tpurec.runtime import heartbeat, storage
from tpurec.runtime.device import DeviceChoice, DeviceKind

STEP_KINDS = ("eager", "compiled", "pipelined")  # --step: tpurec/sharding/step/kinds.py
# Lets --step compiled/pipelined run on a real TPU (compiled runs on a v5e, slower than eager so far;
# pipelined has not run there: docs/tpu.md)
STEP_ON_TPU_FLAG = "TPUREC_STEP_ON_TPU"
# the dense optimizers their update implements (tpurec/sharding/step/dense_supported.py SUPPORTED; here
# without importing torch, for the check before anything starts)
STEP_DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")

if TYPE_CHECKING:
    from tpurec.data.mapping import ColumnSpec

OPTIONS_ENV = "TPUREC_TRAIN_OPTIONS"  # the launcher's JSON of TrainOptions for `python -m tpurec.dlrm`

_CONFIG = "config"  # metadata marker of the fields that override a DLRMConfig field
# Flags that shape the built-in DLRM or its synthetic data, not a --model-module model
BUILT_IN_MODEL_FLAGS = (
    "interaction",
    "embedding_dim",
    "dense_arch",
    "over_arch",
    "multi_hot_sizes",
    "dcn_num_layers",
    "dcn_low_rank_dim",
    "synth_rows",
)


def _override(name: str) -> Any:
    """A flag overriding DLRMConfig field `name`: that field's help and choices, unset (None) by default."""
    declared = flags.flag_metadata(**flags.flag_kwargs(DLRMConfig, name))
    return field(default=None, metadata={**declared, _CONFIG: True})


def _default(name: str) -> Any:
    return next(f.default for f in fields(TrainOptions) if f.name == name)


def _option_value(name: str, value: Any) -> Any:
    """`value` of TrainOptions field `name` read from OPTIONS_ENV (a list as the tuple the flag gives),
    or a UserError naming the field and what it takes."""
    import difflib
    import typing

    known = {f.name: f for f in fields(TrainOptions)}
    if name not in known:
        near = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise UserError(f"{OPTIONS_ENV}: unknown option {name!r}{hint}; it takes the fields of `tpurec train`'s flags")
    hint_type = typing.get_type_hints(TrainOptions)[name]
    args = typing.get_args(hint_type)
    optional = type(None) in args
    kind = next((a for a in args if a is not type(None)), hint_type) if optional else hint_type
    choices = known[name].metadata.get(flags.FLAG_KEY, {}).get("choices")
    if typing.get_origin(kind) is typing.Literal:
        choices, kind = typing.get_args(kind), str
    if value is None and optional:
        return None
    if typing.get_origin(kind) is tuple:
        ok = isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        what = "a list of whole numbers"
        value = tuple(value) if ok else value
    elif kind is float:
        ok, what = isinstance(value, int | float) and not isinstance(value, bool), "a number"
    elif kind is int:
        ok, what = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    elif kind is bool:
        ok, what = isinstance(value, bool), "true or false"
    else:
        ok, what = isinstance(value, str), "a string"
    if ok and choices is not None and value not in choices:
        ok, what = False, "one of " + ", ".join(map(str, choices))
    if not ok:
        raise UserError(
            f"{OPTIONS_ENV}: {name} ({flags.option_string(name)}) is {strict_json.dumps(value)}; it takes {what}"
            + (" or null" if optional else "")
        )
    return value


@dataclass(frozen=True)
class TrainOptions:
    data: str | None = flag(
        None,
        "Parquet dataset (tpurec data convert/synth); default: synthetic data for "
        "the model's tables, generated once into ~/.cache/tpurec",
        metavar="DIR",
    )
    # Parquet tpurec did not write: its column mapping (tpurec/data/mapping.py); inferred when not given
    label: str | None = flag(None, "Parquet without tpurec's metadata: the label column (0/1)", metavar="COL")
    dense: str | None = flag(
        None, "Parquet without tpurec's metadata: dense columns, globs allowed ('f_*')", metavar="COL[,COL...]"
    )
    sparse: str | None = flag(
        None,
        "Parquet without tpurec's metadata: sparse (id) columns, globs allowed; ROWS: the table size "
        "to hash into (default: the model's)",
        metavar="NAME[:ROWS][,...]",
    )
    columns: str | None = flag(
        None,
        "Parquet without tpurec's metadata: a YAML/JSON column mapping (`tpurec data inspect` prints one)",
        metavar="FILE",
    )
    dense_transform: str | None = flag(
        None,
        "log1p: read every dense column as log(1 + max(x, 0)) (Criteo's practice for counts), for Parquet tpurec "
        "did not write and data converted with --raw-dense (tpurec's converted and synthetic data hold it already)",
        choices=("log1p",),
    )
    model: str = flag(DEFAULT_TRAIN_MODEL, f"named config (default {DEFAULT_TRAIN_MODEL})", choices=MODEL_NAMES)
    model_module: str | None = flag(
        None,
        "your own TorchRec model: FN() in module MOD (or FILE.py) returns it, taking (dense, KJT) and returning "
        "logits; trained on --data, with --model's training settings (docs/your_model.md)",
        metavar="MOD:FN",
    )
    interaction: str | None = _override("interaction")
    device: DeviceChoice = flag(
        "auto", "auto (default): TPU when this host has a usable one, else CPU", choices=("auto", "cpu", "tpu")
    )
    batch_size: int | None = _override("batch_size")
    steps: int | None = _override("steps")
    epochs: float | None = _override("epochs")
    eval_every: int | None = _override("eval_every")
    eval_fraction: float | None = _override("eval_fraction")
    embedding_lr: float | None = _override("embedding_lr")
    dense_lr: float | None = _override("dense_lr")
    synth_rows: int | None = _override("synth_rows")
    seed: int | None = _override("seed")
    embedding_dim: int | None = _override("embedding_dim")
    dense_arch: tuple[int, ...] | None = _override("dense_arch")
    over_arch: tuple[int, ...] | None = _override("over_arch")
    multi_hot_sizes: tuple[int, ...] | None = _override("multi_hot_sizes")
    dcn_num_layers: int | None = _override("dcn_num_layers")
    dcn_low_rank_dim: int | None = _override("dcn_low_rank_dim")
    embedding_optimizer: str | None = _override("embedding_optimizer")
    dense_optimizer: str | None = _override("dense_optimizer")
    eps: float | None = _override("eps")
    embedding_weight_decay: float | None = _override("embedding_weight_decay")
    embedding_weight_decay_mode: str | None = _override("embedding_weight_decay_mode")
    warmup_steps: int | None = _override("warmup_steps")
    decay_start: int | None = _override("decay_start")
    decay_steps: int | None = _override("decay_steps")
    checkpoint_dir: str | None = flag(None, "write checkpoints here (periodic and final)", metavar="DIR")
    checkpoint_every: int | None = flag(None, "steps between checkpoints (default: --eval-every)", type=positive_int)
    keep: int = flag(2, "complete checkpoints to keep (0: all; default 2)", type=nonnegative_int)
    keep_best: bool = flag(
        False,
        "also keep the checkpoint of the best eval AUC (over --eval-every's evaluations and the final one) in "
        "--checkpoint-dir/best/, its step and AUC in the result line and its meta.json",
    )
    early_stop: int | None = flag(
        None,
        "stop training after N evaluations (--eval-every) in a row without a higher eval AUC",
        type=positive_int,
        metavar="N",
    )
    resume: str | None = flag(
        None,
        "continue from the newest complete checkpoint in --checkpoint-dir, or from PATH",
        nargs="?",
        const="latest",
        metavar="PATH",
    )
    plan: str | None = flag(None, "use a saved sharding plan instead of planning", metavar="PLAN.json")
    save_plan: str | None = flag(None, "save the plan used (for --plan later)", metavar="PLAN.json")
    # named id_limits from here to the kernel (DMP's id_limits=, KernelSettings.id_limits); the flag
    # keeps its short spelling
    id_limits: str | None = flag(
        None,
        "fixed SparseCore id limits per table, measured by `tpurec data stats` for this layout "
        "(devices, SparseCores, batch per device); batches over them run in several passes",
        metavar="LIMITS.json",
        option="--limits",
    )
    limits_out: str | None = flag(
        None,
        "write each table's id demand seen in training as a limits file (the `tpurec data stats` format), "
        "for --limits next time",
        metavar="LIMITS.json",
    )
    zch: bool = flag(
        False,
        "managed-collision tables: TorchRec's MCH remap gives each table's rows to the raw ids that matter "
        "(eviction by --zch-eviction) instead of the modulo hash; needs raw-id data (data convert/synth "
        "--raw-ids); remapped ids, evictions and occupancy in the result line and --metrics-out",
    )
    zch_eviction: str = flag(
        "lru", "--zch eviction policy: lru (default), lfu or distance_lfu (TorchRec's)", choices=POLICIES
    )
    zch_eviction_interval: int = flag(
        DEFAULT_EVICTION_INTERVAL,
        "--zch: steps between evictions; ids new since the last one share their table's last row "
        f"(default {DEFAULT_EVICTION_INTERVAL})",
        type=step_interval,
        metavar="STEPS",
    )
    host_tier: str | None = flag(
        None,
        "tables kept in host memory behind a cache of their rows on the run's device, each with its load factor "
        "(share of rows cached, default 0.2) and eviction (lru, default, or lfu); `auto` on a TPU: the planner moves "
        "tables that do not fit its HBM there; hits, misses and the hit rate in the result line (docs/host_tier.md)",
        metavar="TABLE[:LF[:lru|lfu]],...|auto",
    )
    metrics_out: str | None = flag(None, "metrics as .csv or .jsonl; curves as FILE.png beside it", metavar="FILE")
    tensorboard: str | None = flag(
        None,
        "write TensorBoard event files here: train/loss, train/samples_per_s, eval/auc, eval/ne, ... (docs/train.md)",
        metavar="DIR",
    )
    curves_out: str | None = flag(
        None,
        "training-curves PNG (default: beside --metrics-out, else CHECKPOINT_DIR/curves.png, else "
        "$TPUREC_CACHE/runs/curves-MODEL-TIME.png; 'none': no PNG)",
        metavar="PNG",
    )
    threads: int | None = flag(None, "torch threads per rank (default: 1 with several ranks)", type=positive_int)
    quiet: bool = flag(False, "no progress bar")
    log_every: int | None = flag(
        None,
        "steps between logged losses, each a device->host read the host waits for "
        "(default: about 100 in a run, 1 to 50 steps apart)",
        type=positive_int,
        metavar="STEPS",
    )
    dist_timeout: float = flag(
        heartbeat.DEFAULT_DIST_TIMEOUT,
        f"seconds a collective may wait for the other ranks (default {heartbeat.DEFAULT_DIST_TIMEOUT:g}; "
        "gloo's own is 1800)",
        type=positive_float,
        metavar="SECONDS",
    )
    heartbeat_timeout: float = flag(
        heartbeat.DEFAULT_TIMEOUT,
        "seconds without a heartbeat from a rank before the others name it and stop the job "
        f"(default {heartbeat.DEFAULT_TIMEOUT:g}; 0: off)",
        type=nonnegative_float,
        metavar="SECONDS",
    )
    pipeline_depth: int = flag(
        4,
        "batches read and prepared ahead in background threads (Parquet decode, KJT, SparseCore CSR inputs; "
        "with several ranks the CSR once the input all-to-all delivers the ids); 0: read inline (default 4)",
        type=nonnegative_int,
    )
    pipeline_workers: int = flag(1, "threads preparing batches ahead (default 1)", type=positive_int)
    step: str = flag(
        "eager",
        "the training step: eager (TorchRec's pipeline, default), compiled (the device half as one "
        "torch.compile graph) or pipelined (SparseCore forward ahead, table update behind: the tables "
        "one step stale, docs/dmp.md 'Pipelined step'); compiled and pipelined update the dense parameters "
        "with --dense-optimizer sgd|adagrad|adam inside the graph, on --device cpu and --emulate-tpu; a batch "
        "over the id limits steps eagerly; compiled needs --limits, pipelined compiles with it",
        choices=STEP_KINDS,
    )

    compile_dense: bool = flag(
        False,
        "with --step eager: each dense module of the model (those holding no embedding table: the DLRM's "
        "arches) runs as a torch.compile program, the embedding lookups and updates eagerly (docs/dlrm.md); "
        "the default on a real TPU (--device tpu without --emulate-tpu)",
    )
    eager_dense: bool = flag(
        False,
        "on a real TPU with --step eager: keep the dense modules eager (there they are compiled by default, "
        "as --compile-dense)",
    )

    def dense_compiled(self, device: str, emulated: bool) -> bool:
        """Whether the eager step's dense modules run compiled: --compile-dense, or by default on a real
        TPU (MLPerf DLRM-DCNv2 on a v5e: 293.3 ms a step against 335.9 eager, docs/results.md session 36);
        elsewhere eager unless asked (on a CPU the compiled modules are slower)."""
        if self.step != "eager" or self.eager_dense:
            return False
        return self.compile_dense or (device == "tpu" and not emulated)

    # ---- building ----
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Every field as a flag of `parser`."""
        flags.add_flags(parser, cls)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> TrainOptions:
        return cls(**flags.values(cls, namespace))

    def to_json(self) -> str:
        return strict_json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainOptions:
        """The options of `to_json`'s text (the launcher's OPTIONS_ENV); a UserError naming OPTIONS_ENV,
        the field and what it takes for text that is not JSON, not an object, or holds a field that
        TrainOptions lacks or a value of the wrong type or outside its choices."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise UserError(
                f"{OPTIONS_ENV} is not JSON ({e}); it holds `tpurec train`'s options as a JSON object"
            ) from None
        if not isinstance(raw, dict):
            raise UserError(
                f"{OPTIONS_ENV} holds {type(raw).__name__}, not a JSON object of `tpurec train`'s options "
                '({"batch_size": 512, ...})'
            )
        return cls(**{name: _option_value(name, value) for name, value in raw.items()})

    # ---- reading ----
    def resume_command(self) -> str:
        """The command that continues this run from its newest checkpoint: the run's flags (read
        back from these options, so a launched rank can say it too) and `--resume`. A multi-host
        launch (--nnodes) is not known to a rank: the command then names only its own host's part."""
        import shlex

        from tpurec.runtime.device import emulated_slice

        words = ["tpurec", "train"]
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if emulated_slice():
            words += ["--emulate-tpu", str(emulated_slice())]
        elif world > 1:
            words += ["--nproc", os.environ.get("LOCAL_WORLD_SIZE", str(world))]
        return shlex.join([*words, *flags.as_argv(self, skip=("resume",)), "--resume"])

    def column_spec(self) -> ColumnSpec | None:
        """The column mapping given for --data (None: none given; inferred if the data needs one)."""
        from tpurec.data.mapping import ColumnSpec

        spec = ColumnSpec(self.label, self.dense, self.sparse, self.columns)
        return spec if spec.given() else None

    def config_overrides(self) -> dict:
        """{DLRMConfig field: value} for the config flags given (None: not given, keep the model's)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.metadata.get(_CONFIG) and getattr(self, f.name) is not None
        }

    def config(self) -> DLRMConfig:
        """The named config with the given flags applied (UserError, one line, for bad values)."""
        return override(get_config(self.model), **self.config_overrides())

    def zch_spec(self) -> ZchSpec | None:
        """The managed-collision tables asked for (--zch), or None: the modulo hash."""
        return ZchSpec(self.zch_eviction, self.zch_eviction_interval) if self.zch else None

    def _zch_problem(self) -> str | None:
        if self.id_limits:  # limits of raw ids for a remapped run, or the reverse
            from tpurec.planner.id_limits import remap_problem

            spec = self.zch_spec()
            problem = remap_problem(self.id_limits, spec.record() if spec is not None else None)
            if problem:
                return problem
        if not self.zch:
            changed = [n for n in ("zch_eviction", "zch_eviction_interval") if getattr(self, n) != _default(n)]
            return f"{flags.option_string(changed[0])} is for --zch" if changed else None
        if not self.data:
            return f"--zch trains on raw ids: give --data DIR ({RAW_IDS_FIX})"
        return zch_data_problem(self.data)

    def curves_path(self, stamp: str) -> str | None:
        """Where the training-curves PNG goes (None: not written); ``stamp`` names a fallback file."""
        if self.curves_out:
            return None if self.curves_out.lower() == "none" else self.curves_out
        if self.metrics_out:
            return os.path.splitext(self.metrics_out)[0] + ".png"
        if self.checkpoint_dir and not storage.is_uri(self.checkpoint_dir):  # a PNG goes to a local file
            return os.path.join(self.checkpoint_dir, "curves.png")
        from tpurec.dlrm.data import cache_root

        name = self.model
        if self.model_module:  # examples/my_model.py:build -> my_model.py_build
            name = "".join(c if c.isalnum() or c in "._-" else "_" for c in os.path.basename(self.model_module))
        return str(cache_root() / "runs" / f"curves-{name}-{stamp}.png")

    def outputs(self) -> list[tuple[str, str | None, str]]:
        """Everything this run writes, as (flag, path, "file" or "dir"), to check before any work."""
        from tpurec.dlrm.data import cache_root

        local_ckpt = self.checkpoint_dir if not storage.is_uri(self.checkpoint_dir) else None  # a bucket's: check()
        found = [
            ("--checkpoint-dir", local_ckpt, "dir"),
            ("--metrics-out", self.metrics_out, "file+dirs"),
            ("--save-plan", self.save_plan, "file"),
            ("--limits-out", self.limits_out, "file"),
            ("--tensorboard", self.tensorboard, "dir"),
        ]
        png = self.curves_path("check")
        if png and (self.curves_out or self.metrics_out or self.checkpoint_dir):
            found.append(("--curves-out" if self.curves_out else "the curves PNG", png, "file+dirs"))
        elif png:  # $TPUREC_CACHE/runs/
            found.append(("TPUREC_CACHE", str(cache_root()), "dir"))
        return found

    def _synth_cache_problem(self) -> str | None:
        """Why the synthetic data of a run without --data cannot be made in the cache, or None."""
        from tpurec.dlrm.configs import synth_multi_hot
        from tpurec.dlrm.data import synth_cache_problem

        if self.data:
            return None
        try:
            cfg = override(
                get_config(self.model), seed=self.seed, synth_rows=self.synth_rows, multi_hot_sizes=self.multi_hot_sizes
            )
        except UserError:
            return None  # a bad override is refused on its own, by name
        return synth_cache_problem(cfg.table_set, cfg.synth_rows, cfg.seed, synth_multi_hot(cfg))

    def _dense_transform_problem(self) -> str | None:
        """--dense-transform for data whose dense values are stored transformed already: refused."""
        if not self.dense_transform:
            return None
        if not self.data:
            return "--dense-transform transforms --data's dense columns; the synthetic data's are log(1 + x) already"
        from tpurec.data.mapped import has_tpurec_metadata
        from tpurec.data.schema import DENSE_RAW, dataset_metadata

        if not storage.path(self.data).exists() or self.column_spec() is not None:
            return None  # read through a column mapping: as stored, raw
        if not has_tpurec_metadata(self.data):
            return None
        stored = dataset_metadata(self.data).get("dense_transform")
        if stored != DENSE_RAW:
            return (
                f"--dense-transform {self.dense_transform}: {self.data}'s dense values are stored as {stored} already "
                "(tpurec data convert/synth); leave out --dense-transform"
            )
        return None

    def _mapping_problem(self) -> str | None:
        """A column mapping that does not fit --data (a column it lacks, of the wrong type) or the
        model (its dense and sparse counts), told once before any rank starts; None for tpurec's own
        data read without a mapping."""
        if not self.data or not storage.path(self.data).exists():
            return None
        from tpurec.data.catalog import get_table_set
        from tpurec.data.mapped import has_tpurec_metadata
        from tpurec.dlrm.data import model_table_sizes

        columns = self.column_spec()
        if self.model_module or (columns is None and has_tpurec_metadata(self.data)):
            return None  # a --model-module's features are checked against the data once it is built
        try:
            defaults = [t.num_embeddings for t in get_table_set(get_config(self.model).table_set).tables]
            model_table_sizes(self.data, defaults, columns)
        except UserError as e:
            return str(e)
        return None

    def _model_module_problem(self) -> str | None:
        """--model-module: the target there (no torch loaded), --data given, and no flag that shapes
        the built-in DLRM or its synthetic data."""
        if not self.model_module:
            return None
        from tpurec.planner.model_module import parse_target

        try:
            parse_target(self.model_module)
        except UserError as e:
            return str(e)
        if not self.data:
            return (
                f"--model-module trains on --data DIR; make one for the model's features with "
                f"`tpurec data synth --model-module {self.model_module} --out DIR`"
            )
        if self.zch:
            return (
                "--zch puts the built-in DLRM's tables behind TorchRec's managed-collision remap; a --model-module "
                "model brings its own (ManagedCollisionEmbeddingBagCollection / -EmbeddingCollection): their features "
                "get the data's raw ids and the run reports the remap's counters without --zch (docs/your_model.md)"
            )
        given = [n for n in BUILT_IN_MODEL_FLAGS if getattr(self, n) not in (None, False)]
        if given:
            return f"{flags.option_string(given[0])} shapes the built-in DLRM; --model-module builds its own model"
        return None

    def _step_problem(self) -> str | None:
        """What --step compiled/pipelined cannot run: their dense update implements torch.optim's SGD,
        Adagrad and Adam (tpurec/sharding/step/dense_update.py), and they take sharded EBCs (the built-in
        DLRM's, a --model-module's) and ECs (on their fixed-shape outputs: training/model.py), not --zch's
        managed-collision modules; both run on the CPU and the
        emulated TPU (on a real one only when STEP_ON_TPU_FLAG asks: not yet run there)."""
        if self.compile_dense and self.eager_dense:
            return "--compile-dense and --eager-dense: choose one"
        if self.step == "eager":
            return None
        if self.compile_dense or self.eager_dense:
            flag = "--compile-dense" if self.compile_dense else "--eager-dense"
            return f"{flag} is for --step eager (--step {self.step} compiles the dense part already)"
        try:
            cfg = self.config()
        except UserError as e:
            return str(e)
        if cfg.dense_optimizer not in STEP_DENSE_OPTIMIZERS:
            known, opt = "|".join(STEP_DENSE_OPTIMIZERS), cfg.dense_optimizer
            return f"--step {self.step} updates the dense parameters with --dense-optimizer {known} (not {opt})"
        if self.zch:  # TorchRec's managed-collision modules: sharded modules the steps do not take
            return f"--step {self.step} trains without {flags.option_string('zch')} (use --step eager)"
        if self.step == "compiled" and not self.id_limits:
            return (
                "--step compiled needs fixed SparseCore buffer sizes: give --limits LIMITS.json (`tpurec data stats`)"
            )
        from tpurec.runtime import env_flags
        from tpurec.runtime.device import emulated_slice

        if self.device == DeviceKind.TPU and not emulated_slice() and not env_flags.is_on(STEP_ON_TPU_FLAG):
            where = (
                "runs on a TPU v5e but slower than --step eager so far (docs/results.md, session 34)"
                if self.step == "compiled"
                else "runs on --device cpu and on --emulate-tpu SLICE; not yet run on a real TPU"
            )
            return f"--step {self.step} {where} (use --step eager there, or {STEP_ON_TPU_FLAG}=1 to try it)"
        return None

    def _best_problem(self) -> str | None:
        """--keep-best and --early-stop compare evaluations: they need --eval-every (and a directory)."""
        if not (self.keep_best or self.early_stop):
            return None
        name = "--keep-best" if self.keep_best else "--early-stop"
        if self.keep_best and not self.checkpoint_dir:
            return "--keep-best keeps a checkpoint in --checkpoint-dir/best/; give --checkpoint-dir"
        try:
            every = self.config().eval_every
        except UserError:
            return None  # the config's own line comes from its check
        if not every:
            return f"{name} compares the evaluations of --eval-every N; give --eval-every (else only the end's)"
        return None

    def check(self, nproc: int = 1, tpu_ranks: bool = False) -> str | None:
        """A one-line message for bad input, checked before anything heavy starts. tpu_ranks: the ranks
        run on a TPU though this process checks as for a CPU run (`--emulate-tpu`'s launcher)."""
        problem = self._model_module_problem() or self._step_problem() or self._best_problem()
        if problem:
            return problem
        if self.data:
            from tpurec.dlrm.data_hint import data_problem

            problem = data_problem(self.data, get_config(self.model).table_set)
            if problem:
                return problem
        from tpurec.dlrm import host_tier

        tpu = tpu_ranks or self.device == DeviceKind.TPU
        problem = host_tier.problem(self.host_tier, plan=self.plan, zch=self.zch, tpu=tpu)
        problem = problem or self._zch_problem() or self._dense_transform_problem()
        if problem:
            return problem
        mapped = [f for f in ("label", "dense", "sparse", "columns") if getattr(self, f) is not None]
        if mapped and not self.data:
            return f"{flags.option_string(mapped[0])} maps the columns of --data DIR; give --data"
        if self.columns and not os.path.isfile(self.columns):
            return f"--columns {self.columns}: file not found (`tpurec data inspect DIR` prints a mapping to save)"
        problem = self._mapping_problem()
        if problem:
            return problem
        if self.data and self.multi_hot_sizes:
            return f"--multi-hot-sizes shapes the synthetic data; --data {self.data} holds its own ids per sample"
        if self.plan and not os.path.isfile(self.plan):
            return f"--plan {self.plan}: file not found"
        if self.id_limits and not os.path.isfile(self.id_limits):
            return f"--limits {self.id_limits}: file not found (write one with `tpurec data stats`)"
        if self.id_limits:  # read now (no torch): a malformed file or value before any data is made
            from tpurec.planner.id_limits import load_limits

            try:
                load_limits(self.id_limits)
            except UserError as e:
                return str(e)
        if self.metrics_out and not self.metrics_out.lower().endswith((".csv", ".jsonl", ".json")):
            return "--metrics-out must end in .csv or .jsonl"
        if self.curves_out and self.curves_out.lower() != "none" and not self.curves_out.lower().endswith(".png"):
            return "--curves-out must end in .png (or be 'none')"
        if self.resume and self.resume == "latest" and not self.checkpoint_dir:
            return "--resume needs --checkpoint-dir (or --resume PATH)"
        if self.resume:
            # A directory that does not exist is a typo, not a first run (which has the directory
            # empty or absent only if --resume is left out): training from scratch would hide it.
            where = self.checkpoint_dir if self.resume == "latest" else self.resume
            assert where is not None  # "latest" without --checkpoint-dir was refused above
            if not storage.path(where).exists():
                return f"--resume: {where} does not exist (leave out --resume to start a new run)"
        if self.checkpoint_dir and storage.is_uri(self.checkpoint_dir):
            problem = storage.dir_problem(self.checkpoint_dir)
            if problem:
                return f"--checkpoint-dir {problem}"
        from tpurec.outputs import output_problem

        problems = (output_problem(name, path, kind) for name, path, kind in self.outputs())
        problem = next((p for p in problems if p), None) or self._synth_cache_problem()
        if problem:  # now, not at the first write minutes (or hours) of training later
            return problem
        for name in ("batch_size", "steps", "checkpoint_every", "synth_rows"):
            v = getattr(self, name)
            if v is not None and v < 1:
                return f"{flags.option_string(name)} must be >= 1"
        if nproc < 1:
            return "--nproc must be >= 1"
        if self.device == DeviceKind.TPU:
            from tpurec.runtime.device import emulated_slice, tpu_status

            missing = [] if emulated_slice() else tpu_status().missing(cpu="--device cpu")
            if missing:
                return f"--device tpu: this host cannot run TPU kernels ({'; '.join(missing)}); see `tpurec env`"
        return None
