"""Named DLRM / DLRM-DCNv2 configurations: a small dataclass per model, overridable field by field.

`tpurec train --model NAME` starts from one of CONFIGS; every CLI flag that is given replaces the
matching field (dataclasses.replace), so a config is also the record of what a run used. The fields
made with `flag(...)` are those flags: their help text lives here, on the field, and
`tpurec.dlrm.options.TrainOptions` turns them into `tpurec train` options (default: the model's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from tpurec.argtypes import (
    fraction_below_one,
    int_list,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    seed_int,
)
from tpurec.data.catalog import TRAINING_DEFAULTS
from tpurec.dlrm.flags import flag
from tpurec.embedding.optimizers.registry import spec_names
from tpurec.errors import UserError


@dataclass(frozen=True)
class DLRMConfig:
    name: str
    table_set: str  # tpurec/data/catalog.py: the embedding tables (and the synthetic data's)
    # "dot" = DLRM, "dcn" = DLRM-DCNv2 (low-rank cross layers)
    interaction: str = flag(
        "dot",
        "dot (DLRM) or dcn (DLRM-DCNv2 cross layers); default: the model's",
        choices=("dot", "dcn"),
        aliases=("--interaction-type", "--interaction_type"),
    )
    # Architecture. The flag names follow TorchRec's DLRM example (--embedding_dim,
    # --dense_arch_layer_sizes, --over_arch_layer_sizes, --interaction_type, --dcn_num_layers,
    # --dcn_low_rank_dim), accepted with dashes or underscores.
    embedding_dim: int | None = flag(
        None,
        "every table's embedding dim (default: the model's tables')",
        type=positive_int,
        aliases=("--embedding_dim",),
    )
    dense_arch: tuple[int, ...] = flag(
        (64, 16),
        "bottom MLP sizes, e.g. 512,256,128; the last must equal the embedding dim",
        type=int_list,
        aliases=("--dense-arch-layer-sizes", "--dense_arch_layer_sizes"),
    )
    over_arch: tuple[int, ...] = flag(
        (64, 32, 1),
        "top MLP sizes, ending in 1 (the logit), e.g. 1024,1024,512,256,1",
        type=int_list,
        aliases=("--over-arch-layer-sizes", "--over_arch_layer_sizes"),
    )
    multi_hot_sizes: tuple[int, ...] | None = flag(
        None,
        "ids per sample of each feature of the synthetic data, e.g. 3,2,1,... (one per table; default: "
        "the table set's pooling factors); real data brings its own",
        type=int_list,
        aliases=("--multi_hot_sizes",),
    )
    dcn_num_layers: int = flag(
        3, "cross layers with --interaction dcn", type=positive_int, aliases=("--dcn_num_layers",)
    )
    dcn_low_rank_dim: int = flag(
        512, "rank of the cross layers with --interaction dcn", type=positive_int, aliases=("--dcn_low_rank_dim",)
    )
    # Optimisers: the tables' update is fused into backward (apply_optimizer_in_backward); the dense
    # MLPs use a regular torch optimiser. Names: sgd | adagrad | rowwise_adagrad | adam.
    embedding_optimizer: str = flag("rowwise_adagrad", "fused table optimiser", choices=spec_names())
    embedding_lr: float = flag(0.1, "learning rate of the fused table optimiser", type=nonnegative_float)
    dense_optimizer: str = flag("adagrad", "optimiser of the dense MLPs", choices=spec_names())
    dense_lr: float = flag(0.1, "learning rate of the dense (MLP) optimiser", type=nonnegative_float)
    eps: float = flag(1e-8, "epsilon of Adagrad / Adam (tables and MLPs)", type=nonnegative_float)
    # FBGEMM's weight decay of the fused table optimiser (tpurec/embedding/optimizers/weight_decay.py):
    # row-wise Adagrad L2 or DECOUPLE, Adam decoupled; 0: none.
    embedding_weight_decay: float = flag(
        0.0, "weight decay of the fused table optimiser (0: none)", type=nonnegative_float
    )
    embedding_weight_decay_mode: str = flag(
        "NONE",
        "FBGEMM's weight_decay_mode of the fused table optimiser: L2 or DECOUPLE (row-wise Adagrad), "
        "NONE or DECOUPLE (Adam: decoupled either way)",
        choices=("NONE", "L2", "DECOUPLE"),
    )
    # Learning-rate schedule applied to both: linear warm-up over `warmup_steps`, constant until
    # `decay_start`, then polynomial (power 2) decay to 0 over `decay_steps` (0 = no warm-up/decay).
    warmup_steps: int = flag(0, "linear learning-rate warm-up steps (0: none)", type=nonnegative_int)
    decay_start: int = flag(0, "step where the power-2 learning-rate decay starts", type=nonnegative_int)
    decay_steps: int = flag(0, "steps of the decay to 0 (0: no decay)", type=nonnegative_int)
    batch_size: int = flag(512, "batch size per rank (config default)", type=positive_int)
    steps: int | None = flag(
        None, "training steps (overrides --epochs)", type=positive_int
    )  # None: run `epochs` epochs
    epochs: float = flag(1.0, "passes over the training split (config default 1)", type=positive_float)
    eval_every: int = flag(0, "evaluate every N steps (0: only at the end)", type=nonnegative_int)
    eval_fraction: float = flag(0.05, "held-out share of the data (config default 0.05)", type=fraction_below_one)
    # rows of the synthetic dataset made when no --data is given
    synth_rows: int = flag(200_000, "rows of the default synthetic dataset", type=positive_int)
    seed: int = flag(0, "seed for init, shuffling and synthetic data (default 0)", type=seed_int)

    def to_dict(self) -> dict:
        return asdict(self)


CONFIGS: dict[str, DLRMConfig] = {
    # CPU default. Sized so that `tpurec train` with no argument trains to within 0.02 AUC of the
    # synthetic data's oracle in about a minute on 2 cores (see docs/dlrm.md for the measured run).
    "dlrm-tiny": DLRMConfig(
        name="dlrm-tiny",
        table_set="dlrm-tiny",
        dense_arch=(64, 16),
        over_arch=(64, 32, 1),
        embedding_optimizer=TRAINING_DEFAULTS["dlrm-tiny"].embedding_optimizer,
        embedding_lr=0.1,
        dense_optimizer="adagrad",
        dense_lr=0.05,
        batch_size=TRAINING_DEFAULTS["dlrm-tiny"].batch_size,
        epochs=1.0,
        eval_every=500,
        synth_rows=1_500_000,
        dcn_low_rank_dim=64,  # used with --interaction dcn (then --dense-lr 0.005: the cross layers diverge at 0.05)
    ),
    # torchrec's DLRM example for Criteo Kaggle (examples/dlrm): dim 128, 512-256-128 / 1024-1024-512-256-1.
    "criteo-kaggle": DLRMConfig(
        name="criteo-kaggle",
        table_set="criteo-kaggle",
        dense_arch=(512, 256, 128),
        over_arch=(1024, 1024, 512, 256, 1),
        embedding_optimizer=TRAINING_DEFAULTS["criteo-kaggle"].embedding_optimizer,
        embedding_lr=0.05,
        dense_optimizer="adagrad",
        dense_lr=0.05,
        batch_size=TRAINING_DEFAULTS["criteo-kaggle"].batch_size,
        # Adagrad's first step moves every dense weight by the full lr whatever its gradient: at 0.05
        # the 1024-wide top MLP's logits reach 1e5 on step 2 (loss 535,139 on the Criteo sample);
        # ramping the lr up over the first steps keeps the loss near 0.69 (tests/dlrm/test_first_steps.py).
        warmup_steps=100,
        epochs=1.0,
        eval_every=1000,
        synth_rows=2_000_000,
    ),
    # MLPerf Training DLRM-DCNv2 reference (recommendation_v2/torchrec_dlrm): dims 128, bottom
    # 512-256-128, top 1024-1024-512-256-1, 3 DCN layers of rank 512, Adagrad (lr 0.005, eps 1e-8)
    # for tables and MLPs, global batch 65,536, one epoch; the reference passes its warm-up/decay
    # flags as 0 (no schedule), kept here as fields so a submission's schedule can be set.
    "mlperf-dcnv2": DLRMConfig(
        name="mlperf-dcnv2",
        table_set="mlperf-dcnv2",
        interaction="dcn",
        dense_arch=(512, 256, 128),
        over_arch=(1024, 1024, 512, 256, 1),
        dcn_num_layers=3,
        dcn_low_rank_dim=512,
        embedding_optimizer=TRAINING_DEFAULTS["mlperf-dcnv2"].embedding_optimizer,
        embedding_lr=0.005,
        dense_optimizer="adagrad",
        dense_lr=0.005,
        eps=1e-8,
        warmup_steps=0,
        decay_start=0,
        decay_steps=0,
        batch_size=TRAINING_DEFAULTS["mlperf-dcnv2"].batch_size,
        epochs=1.0,
        eval_every=2000,
        synth_rows=2_000_000,
    ),
}

OPTIMIZERS = spec_names()  # every module of tpurec/embedding/optimizers


def get_config(name: str) -> DLRMConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise UserError(f"unknown model {name!r}; one of {', '.join(CONFIGS)}") from None


def override(cfg: DLRMConfig, **changes: Any) -> DLRMConfig:
    """cfg with the given fields replaced; None values mean "not given" and are ignored."""
    names = {f.name for f in fields(DLRMConfig)}
    bad = set(changes) - names
    if bad:
        raise UserError(f"unknown config field(s) {sorted(bad)}")
    given: dict[str, Any] = {  # JSON lists as tuples
        k: tuple(v) if isinstance(v, list) else v for k, v in changes.items() if v is not None
    }
    out = replace(cfg, **given)
    validate(out)
    return out


def embedding_dims(cfg: DLRMConfig) -> list[int]:
    """Each table's embedding dim: --embedding-dim for all, else the table set's own."""
    from tpurec.data.catalog import get_table_set

    return [cfg.embedding_dim or t.embedding_dim for t in get_table_set(cfg.table_set).tables]


def validate(cfg: DLRMConfig) -> None:
    """One-line errors for settings that would otherwise fail deep inside torchrec."""
    from tpurec.data.catalog import get_table_set

    dim = embedding_dims(cfg)[0]
    if cfg.interaction not in ("dot", "dcn"):
        raise UserError(f"interaction must be 'dot' or 'dcn', not {cfg.interaction!r}")
    if cfg.dense_arch[-1] != dim:
        raise UserError(f"the bottom MLP must end in the embedding dim {dim}, got {list(cfg.dense_arch)}")
    if cfg.over_arch[-1] != 1:
        raise UserError(f"the top MLP must end in 1 logit, got {list(cfg.over_arch)}")
    for k in ("embedding_optimizer", "dense_optimizer"):
        if getattr(cfg, k) not in OPTIMIZERS:
            raise UserError(f"{k} must be one of {', '.join(OPTIMIZERS)}")
    if cfg.multi_hot_sizes is not None:
        n = len(get_table_set(cfg.table_set).tables)
        if len(cfg.multi_hot_sizes) != n or min(cfg.multi_hot_sizes) < 1:
            raise UserError(f"--multi-hot-sizes needs {n} sizes >= 1 (one per table), got {list(cfg.multi_hot_sizes)}")
    if cfg.batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    if cfg.steps is not None and cfg.steps < 1:
        raise UserError("--steps must be >= 1")
    if cfg.epochs <= 0:
        raise UserError("--epochs must be > 0")
    if cfg.eval_every < 0:
        raise UserError("--eval-every must be >= 0")
    if not 0.0 < cfg.eval_fraction < 1.0:
        raise UserError("--eval-fraction must be in (0, 1)")


__all__ = ["DLRMConfig", "CONFIGS", "get_config", "override", "validate", "field"]


def synth_multi_hot(cfg: DLRMConfig) -> list[int] | None:
    """Ids per sample of each feature of the synthetic data when --multi-hot-sizes sets them."""
    return list(cfg.multi_hot_sizes) if cfg.multi_hot_sizes is not None else None
