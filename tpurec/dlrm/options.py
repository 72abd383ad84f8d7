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
from typing import Any

from tpurec import strict_json
from tpurec.argtypes import nonnegative_float, nonnegative_int, positive_float, positive_int
from tpurec.catalog import MODEL_NAMES
from tpurec.dlrm import flags
from tpurec.dlrm.configs import DLRMConfig, get_config, override
from tpurec.dlrm.flags import flag
from tpurec.errors import UserError
from tpurec.runtime import heartbeat
from tpurec.runtime.device import DeviceChoice

OPTIONS_ENV = "TPUREC_TRAIN_OPTIONS"  # the launcher's JSON of TrainOptions for `python -m tpurec.dlrm`

_CONFIG = "config"  # metadata marker of the fields that override a DLRMConfig field


def _override(name: str) -> Any:
    """A flag overriding DLRMConfig field `name`: that field's help and choices, unset (None) by default."""
    declared = flags.flag_metadata(**flags.flag_kwargs(DLRMConfig, name))
    return field(default=None, metadata={**declared, _CONFIG: True})


@dataclass(frozen=True)
class TrainOptions:
    data: str | None = flag(
        None,
        "Parquet dataset (tpurec data convert/synth); default: synthetic data for "
        "the model's tables, generated once into ~/.cache/tpurec",
        metavar="DIR",
    )
    model: str = flag("dlrm-tiny", "named config (default dlrm-tiny)", choices=MODEL_NAMES)
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
    resume: str | None = flag(
        None,
        "continue from the newest complete checkpoint in --checkpoint-dir, or from PATH",
        nargs="?",
        const="latest",
        metavar="PATH",
    )
    plan: str | None = flag(None, "use a saved sharding plan instead of planning", metavar="PLAN.json")
    save_plan: str | None = flag(None, "save the plan used (for --plan later)", metavar="PLAN.json")
    limits: str | None = flag(
        None,
        "fixed SparseCore id limits per table, measured by `tpurec data stats` for this layout "
        "(devices, SparseCores, batch per device); batches over them run in several passes",
        metavar="LIMITS.json",
    )
    limits_out: str | None = flag(
        None,
        "write each table's id demand seen in training as a limits file (the `tpurec data stats` format), "
        "for --limits next time",
        metavar="LIMITS.json",
    )
    metrics_out: str | None = flag(None, "metrics as .csv or .jsonl; curves as FILE.png beside it", metavar="FILE")
    curves_out: str | None = flag(
        None,
        "training-curves PNG (default: beside --metrics-out, else CHECKPOINT_DIR/curves.png, else "
        "$TPUREC_CACHE/runs/curves-MODEL-TIME.png; 'none': no PNG)",
        metavar="PNG",
    )
    threads: int | None = flag(None, "torch threads per rank (default: 1 with several ranks)", type=positive_int)
    quiet: bool = flag(False, "no progress bar")
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
        return cls(**json.loads(text))

    # ---- reading ----
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

    def curves_path(self, stamp: str) -> str | None:
        """Where the training-curves PNG goes (None: not written); ``stamp`` names a fallback file."""
        if self.curves_out:
            return None if self.curves_out.lower() == "none" else self.curves_out
        if self.metrics_out:
            return os.path.splitext(self.metrics_out)[0] + ".png"
        if self.checkpoint_dir:
            return os.path.join(self.checkpoint_dir, "curves.png")
        from tpurec.dlrm.data import cache_root

        return str(cache_root() / "runs" / f"curves-{self.model}-{stamp}.png")

    def outputs(self) -> list[tuple[str, str | None, str]]:
        """Everything this run writes, as (flag, path, "file" or "dir"), to check before any work."""
        from tpurec.dlrm.data import cache_root

        found = [
            ("--checkpoint-dir", self.checkpoint_dir, "dir"),
            ("--metrics-out", self.metrics_out, "file+dirs"),
            ("--save-plan", self.save_plan, "file"),
            ("--limits-out", self.limits_out, "file"),
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

    def check(self, nproc: int = 1) -> str | None:
        """A one-line message for bad input, checked before anything heavy starts."""
        if self.data:
            from tpurec.dlrm.data_hint import data_problem

            problem = data_problem(self.data, get_config(self.model).table_set)
            if problem:
                return problem
        if self.data and self.multi_hot_sizes:
            return f"--multi-hot-sizes shapes the synthetic data; --data {self.data} holds its own ids per sample"
        if self.plan and not os.path.isfile(self.plan):
            return f"--plan {self.plan}: file not found"
        if self.limits and not os.path.isfile(self.limits):
            return f"--limits {self.limits}: file not found (write one with `tpurec data stats`)"
        if self.limits:  # read now (no torch): a malformed file or value before any data is made
            from tpurec.planner.id_limits import load_limits

            try:
                load_limits(self.limits)
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
            if not os.path.exists(where):
                return f"--resume: {where} does not exist (leave out --resume to start a new run)"
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
        if self.device == "tpu":
            from tpurec.runtime.device import emulated_slice, tpu_status

            missing = [] if emulated_slice() else tpu_status().missing()
            if missing:
                return f"--device tpu: this host cannot run TPU kernels ({'; '.join(missing)}); see `tpurec env`"
        return None
