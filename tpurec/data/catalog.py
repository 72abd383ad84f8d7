"""Named embedding-table sets: the 26 Criteo categorical features at three scales.

In tpurec.data (layer 1, docs/architecture.md), and plain data without torch: the data converter and
synthetic generator, the planner/inspector (`tpurec plan --model ...`) and the DLRM configs all read
it, so that `dlrm-tiny` data, plans and models always agree, and every CLI offers the same model
names without importing anything heavy. TorchRec's `EmbeddingBagConfig`s are built from a TableSet by
`tpurec.dlrm.model.embedding_bag_configs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tpurec.errors import UserError

NUM_SPARSE = 26
NUM_DENSE = 13
# Feature names follow the Merlin/HugeCTR Criteo convention (C1..C26); table names prefix "t_".
FEATURE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]

# Criteo Kaggle (Display Advertising Challenge) vocabulary sizes per categorical feature, as used by
# torchrec's DLRM example (examples/dlrm README, --num_embeddings_per_feature for Kaggle).
CRITEO_KAGGLE_ROWS = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]
# MLPerf Training DLRM-DCNv2 (Criteo 1TB, multi-hot): capped vocabulary sizes and multi-hot sizes,
# from the MLPerf training reference (recommendation_v2/torchrec_dlrm, --num_embeddings_per_feature
# and --multi_hot_sizes). 26 tables, 204,184,588 rows in all.
MLPERF_DCNV2_ROWS = [
    40000000,
    39060,
    17295,
    7424,
    20265,
    3,
    7122,
    1543,
    63,
    40000000,
    3067956,
    405282,
    10,
    2209,
    11938,
    155,
    4,
    976,
    14,
    40000000,
    40000000,
    40000000,
    590152,
    12973,
    108,
    36,
]
MLPERF_DCNV2_MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
# dlrm-tiny: Kaggle sizes capped at 1000 rows, so the CPU default trains in about a minute.
DLRM_TINY_ROWS = [min(r, 1000) for r in CRITEO_KAGGLE_ROWS]


@dataclass(frozen=True)
class TableSpec:
    name: str
    feature: str
    num_embeddings: int
    embedding_dim: int
    pooling_factor: float  # mean ids per sample, summed over the table's features (1 = one-hot)
    data_type: str = "fp32"  # the table's dtype: fp32, fp16 or bf16 (TorchRec DataType, lower case)
    # Every feature the table serves, when more than `feature` (TorchRec's feature_names); each is
    # pooled into its own output row.
    extra_features: tuple[str, ...] = ()
    pooling: str = "sum"  # sum or mean (TorchRec PoolingType, lower case)
    weighted: bool = False  # ids carry per-id weights (an is_weighted EmbeddingBagCollection)

    def __post_init__(self) -> None:
        # a JSON round trip (plan meta) hands back a list; keep the spec hashable
        object.__setattr__(self, "extra_features", tuple(self.extra_features))

    @property
    def feature_names(self) -> list[str]:
        return [self.feature, *self.extra_features]


@dataclass(frozen=True)
class TableSet:
    name: str
    tables: tuple[TableSpec, ...]


def _make(name: str, rows: list[int], dim: int, pooling: Sequence[float] | None = None) -> TableSet:
    pooling = pooling or [1.0] * NUM_SPARSE
    return TableSet(
        name, tuple(TableSpec(f"t_{f}", f, r, dim, float(p)) for f, r, p in zip(FEATURE_NAMES, rows, pooling))
    )


TABLE_SETS: dict[str, TableSet] = {
    "dlrm-tiny": _make("dlrm-tiny", DLRM_TINY_ROWS, 16),
    "criteo-kaggle": _make("criteo-kaggle", CRITEO_KAGGLE_ROWS, 128),
    "mlperf-dcnv2": _make("mlperf-dcnv2", MLPERF_DCNV2_ROWS, 128, MLPERF_DCNV2_MULTI_HOT),
}


@dataclass(frozen=True)
class TrainingDefaults:
    """What the DLRM training config of a model uses, as plain facts: `tpurec plan --model NAME`
    plans with them (tpurec.sharding may not import tpurec.dlrm), and tpurec/dlrm/configs.py builds
    its configs from them, so the two cannot disagree."""

    embedding_optimizer: str  # a tpurec.embedding.optimizers registry name
    batch_size: int  # per rank


TRAINING_DEFAULTS: dict[str, TrainingDefaults] = {
    "dlrm-tiny": TrainingDefaults("rowwise_adagrad", 512),
    "criteo-kaggle": TrainingDefaults("rowwise_adagrad", 2048),
    # MLPerf reference: Adagrad, global batch 65,536 over 8 GPUs
    "mlperf-dcnv2": TrainingDefaults("adagrad", 8192),
}


# `tpurec train`'s --model when none is given; a --model-module run takes its training settings
# (the tables' optimizer among them) from it, and `tpurec plan --model-module` plans with the same.
DEFAULT_TRAIN_MODEL = "dlrm-tiny"


def model_module_optimizer(own: str | None, training_model: str | None = None) -> tuple[str, str]:
    """(the tables' optimizer, where it comes from) of a `--model-module` model, as `tpurec train`
    resolves it and `tpurec plan` prints it: the model's own (apply_optimizer_in_backward), else the
    --embedding-optimizer of the training config (--model, default DEFAULT_TRAIN_MODEL)."""
    if own:
        return own, "the model's own, set with apply_optimizer_in_backward"
    name = training_model or DEFAULT_TRAIN_MODEL
    return (
        TRAINING_DEFAULTS[name].embedding_optimizer,
        f"the model sets none: tpurec train's default, --model {name}'s --embedding-optimizer",
    )


# The named models every CLI offers (`tpurec train --model`, `tpurec plan --model`): each DLRM
# config of tpurec/dlrm/configs.py is named after the table set it trains.
MODEL_NAMES: tuple[str, ...] = tuple(TABLE_SETS)


def get_table_set(name: str) -> TableSet:
    try:
        return TABLE_SETS[name]
    except KeyError:
        raise UserError(f"unknown model/table set {name!r}; one of {', '.join(TABLE_SETS)}") from None
