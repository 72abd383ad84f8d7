"""A rank's result: the figures of the result line (the final evaluation, the pace, the slice and
what it compiled and copied, the id limits, the remap, the best evaluation), rank 0's summary on
stderr and its one JSON line on stdout, and the files beside it (the curves PNG, `--metrics-out`,
`--tensorboard`, `--limits-out`, `--save-plan`), whose failures never end the run before the line."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from tpurec import strict_json
from tpurec.dlrm.report import summary_text
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from tpurec.dlrm.training.data import TrainingData
    from tpurec.dlrm.training.model import ShardedModel
    from tpurec.dlrm.training.progress import Progress
    from tpurec.dlrm.training.rank_run import RankRun
    from tpurec.dlrm.training.side_outputs import SideOutputs


class Reporting:
    def __init__(
        self, run: RankRun, data: TrainingData, model: ShardedModel, outputs: SideOutputs, progress: Progress
    ) -> None:
        self.run, self.data, self.model, self.outputs, self.progress = run, data, model, outputs, progress

    def result(self, final: dict, step: int, eager_steps: int | None, best: dict) -> dict:
        """The result line's figures after the final evaluation (`final`) at `step` (every rank: some
        are gathered over all ranks)."""
        run, p, batch = self.run, self.progress, self.data.batch_size
        sps = p.steps_run * batch * run.world / p.train_seconds if p.train_seconds > 0 else 0.0
        result: dict[str, Any] = {
            "steps": step,
            "auc": round(final["auc"], 6),
            "ne": round(final["ne"], 6),
            "logloss": round(final["logloss"], 6),
            "accuracy": round(final["accuracy"], 6),
            "samples_per_s": round(sps, 1),
            "eval_rows": final["rows"],
            "world_size": run.world,
            "batch_size": batch,
            "model": run.model_name,
            "step": run.options.step,
            # the eager step's dense modules and their optimizer's step: compiled (--compile-dense, a real
            # TPU's default) or eager
            "dense": "compiled"
            if run.options.dense_compiled(run.device, run.emulation.topology is not None)
            else "eager",
            "seconds": round(time.perf_counter() - p.t_start, 2),
            # steps far slower on the host than those before them: on a TPU, programs compiled mid-run
            "slow_steps": p.slow_steps.figures(),
        }
        if self.data.oracle_auc:
            result["oracle_auc"] = self.data.oracle_auc
        if eager_steps is not None:  # batches over their fixed id limits leave the graph: how many
            result["eager_steps"] = eager_steps
        result.update(self._slice_figures())
        result.update(best)
        result["id_limits"] = self._id_limit_figures(step)
        if self.model.remap is not None:
            result["zch"] = self._remap_figures(step)
        if self.data.host_tier_tables:
            from tpurec.dlrm import host_tier

            result["host_tier"] = host_tier.figures(self.model.dmp, self.data.host_tier_tables, run.world)
            run.say(host_tier.summary(result["host_tier"]))
        return result

    def _slice_figures(self) -> dict:
        """Hosts, and on the TPU path what TorchTPU compiles (measured by the emulation's stand-in of
        its ops) and the device->host copies in the training steps."""
        run, device = self.run, self.run.device
        local = int(os.environ.get("LOCAL_WORLD_SIZE", run.world))
        out: dict = {"hosts": max(1, run.world // max(1, local))}
        if device == DeviceKind.TPU:
            out["uneven_all_to_all"] = getattr(self.model.dmp, "uneven_all_to_all", None)
            out["hbm"] = self._hbm_figures()
        out.update(run.emulation.compile_figures(device))
        if device == DeviceKind.TPU:
            # tpurec's own device->host copies in the training steps (tpurec.runtime.host_copies): on an emulated
            # rank, of the tensors a real rank holds on its TPU.
            copies, steps, warmup = run.emulation.train_copies(self.progress.train_copies, self.progress.steps_run)
            if warmup is not None:
                out["device_to_host_copies_in_warmup"] = warmup
            out["device_to_host_copies_per_step"] = round(sum(copies.values()) / max(1, steps), 4)
            out["device_to_host_copies"] = dict(sorted(copies.items()))
        return out

    def _hbm_figures(self) -> dict:
        """The plan's HBM figure for this rank's device beside the bytes the device's allocator holds at
        the end of training and the most it held at a logged step (torch.accelerator; None where it
        gives no reading: the emulated device), and planned over each (issue #59's bar: within 10%;
        the end's reading is after the last step's temporaries are freed, so the most is the one)."""
        import torch

        planned = self.model.planned_hbm_bytes
        try:
            in_use: int | None = int(torch.accelerator.memory_allocated())
        except Exception:  # no accelerator statistics here (the emulated device, a CPU build)
            in_use = None
        most = self.progress.max_device_bytes
        most = max(most, in_use) if most is not None and in_use is not None else most or in_use

        def over(x: int | None) -> float | None:
            return round(planned / x, 4) if planned and x else None

        return {
            "planned_bytes": planned,
            "in_use_bytes": in_use,
            "planned_over_in_use": over(in_use),
            "max_in_use_bytes": most,
            "planned_over_max_in_use": over(most),
        }

    def _id_limit_figures(self, step: int) -> dict:
        """The limits used, the stack inputs run in several passes and the ids dropped (all ranks);
        with --limits-out, each table's demand written as a limits file."""
        import torch

        from tpurec.dlrm import id_feedback

        run, o, dmp = self.run, self.run.options, self.model.dmp
        mine = id_feedback.summary(dmp)
        counts = torch.tensor([mine["multipass_batches"], mine["dropped_ids"]], dtype=torch.int64)
        if run.world > 1:
            import torch.distributed as dist

            dist.all_reduce(counts)
        out: dict[str, Any] = {
            "limits": o.id_limits,
            "multipass_batches": int(counts[0]),
            "dropped_ids": int(counts[1]),
        }
        demand, passes = id_feedback.merged(dmp, run.world)
        out["tables"] = id_feedback.per_table(demand, passes)
        for name, figures in out["tables"].items():
            self.progress.metrics.add({"kind": "id_demand", "step": step, "table": name, **figures})
        if o.limits_out:
            kernels = id_feedback.every_kernel(dmp)
            layout = {
                "topology": run.emulation.topology,
                "world_size": run.world,
                "sparsecores_per_device": kernels[0].num_sc if kernels else 0,
                "batch_size_per_device": self.data.batch_size,
            }
            if run.rank == 0:
                with self.outputs.kept():
                    zch = o.zch_spec()
                    doc = id_feedback.limits_document(
                        demand, layout, o.data or "synthetic", zch=zch.record() if zch is not None else None
                    )
                    id_feedback.write(o.limits_out, doc)
                    run.say(f"id limits seen in training written to {o.limits_out} ({len(demand)} tables)")
            out["limits_out"] = o.limits_out
        return out

    def _remap_figures(self, step: int) -> dict:
        """--zch: the result line's remap figures (all ranks), each table's in --metrics-out."""
        remap, world = self.model.remap, self.run.world
        assert remap is not None
        for name, t in remap.per_table(world).items():
            self.progress.metrics.add(
                {
                    "kind": "zch_table",
                    "step": step,
                    "table": name,
                    "zch_remapped_ids": t["ids"],
                    "zch_hit_rate": round(t["hits"] / t["ids"], 6) if t["ids"] else None,
                    "zch_evictions": t["evictions"],
                    "zch_occupancy": t["occupancy"],
                }
            )
        return remap.figures(world)

    def report(self, result: dict) -> None:
        """Rank 0: the files, the summary and the JSON line; every rank: the files that failed, after it."""
        if self.run.rank != 0:
            self.outputs.raise_any()  # another host's copy of --save-plan
            return
        self.write_curves()
        self.run.say(summary_text(result, self.data.data_dir))
        # One strict JSON line: a non-finite metric is null, never a bare NaN that JSON parsers refuse.
        # Short: each table's id demand (26 to hundreds of tables) goes to the metrics file's
        # id_demand rows and --limits-out, not into the line (run() still returns it).
        line = dict(result, id_limits={k: v for k, v in result["id_limits"].items() if k != "tables"})
        print(strict_json.dumps(line), flush=True)
        # after the result line: the training it reports finished; the run still fails (exit 2)
        self.outputs.raise_any()

    def write_curves(self) -> None:
        """The curves PNG, the metrics file's last write and TensorBoard's (rank 0); a file that
        cannot be written is kept in the side outputs' failures, the others named in the log."""
        run, o, metrics, outputs = self.run, self.run.options, self.progress.metrics, self.outputs
        png = o.curves_path(time.strftime("%Y%m%d-%H%M%S"))
        if png:
            from tpurec.dlrm.plots import plot_curves

            with outputs.kept():
                plot_curves(
                    metrics.records,
                    png,
                    title=f"{run.model_name}, {run.world} rank(s), batch {self.data.batch_size}/rank",
                    oracle_auc=self.data.oracle_auc,
                    flag="--curves-out" if o.curves_out else "the curves PNG",
                )
        metrics.flush()
        if metrics.failure:
            outputs.failures.append(metrics.failure)
        tensorboard = metrics.tensorboard
        if tensorboard is not None:
            tensorboard.close()
            if tensorboard.failure:
                outputs.failures.append(tensorboard.failure)
        written = (("metrics", o.metrics_out, metrics.failure), ("curves", png, png and outputs.failed(png)))
        if any(v and not failed for _, v, failed in written):
            run.say(", ".join(f"{k}: {v}" for k, v, failed in written if v and not failed))
