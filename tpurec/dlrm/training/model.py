"""A rank's model: the user's (`--model-module`) or the built-in DLRM, sharded by the DMP (on `--plan`
when given), the managed-collision remaps it counts (`--zch`, a user model's own), and the plan it
trains, summarised (rank 0) and saved (`--save-plan`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpurec.dlrm.rank_setup import log
from tpurec.dlrm.report import plan_report, plan_report_of, plan_summary
from tpurec.errors import UserError

if TYPE_CHECKING:
    import torch

    from tpurec.dlrm.training.data import TrainingData
    from tpurec.dlrm.training.rank_run import RankRun
    from tpurec.dlrm.training.side_outputs import SideOutputs
    from tpurec.dlrm.zch import RemapCounters


def load_user_model(run: RankRun) -> None:
    """`--model-module`: the user's model, built before the data (which is checked against its
    features); the steps it cannot take refused, its remaps that do not spread over the ranks said."""
    from tpurec.dlrm.user_model import load

    o = run.options
    assert o.model_module is not None
    run.user = load(o.model_module, run.cfg.seed)
    remapped = run.user.remap_ranges()
    if o.step != "eager" and remapped:  # as --zch: TorchRec's sharded remaps, which the steps do not take
        raise UserError(
            f"--step {o.step} trains without managed-collision tables (--model-module {o.model_module}: "
            f"features {', '.join(remapped)}); use --step eager"
        )
    if run.rank == 0:
        from tpurec.planner.model_module import unspread_remaps

        for line in unspread_remaps(run.user.module, run.world):
            log.warning(line)


def _holds_embedding_collection(model: torch.nn.Module) -> bool:
    from torchrec.modules.embedding_modules import EmbeddingCollection

    return any(isinstance(m, EmbeddingCollection) for m in model.modules())


class ShardedModel:
    """After `build()`: `dmp` (the model in TorchRec's DistributedModelParallel) and `remap` (the
    managed-collision remaps' counters, tpurec.dlrm.zch; None without any)."""

    def __init__(self, run: RankRun) -> None:
        self.run = run
        self.remap: RemapCounters | None = None
        self.planned_hbm_bytes: int | None = None  # the plan's HBM figure for this rank's device, once planned

    def build(self, data: TrainingData) -> None:
        import torch

        from tpurec.dlrm.model import build_model, shard
        from tpurec.planner.plan_check import PlanMismatchError

        run, cfg, o = self.run, self.run.cfg, self.run.options
        torch.manual_seed(cfg.seed)
        zch = o.zch_spec()
        if zch is not None:
            self._zch_table_sizes(data)
        constraints = None  # the built-in DLRM's (model.planner_constraints)
        if run.user is not None:
            from tpurec.dlrm.user_model import apply_table_optimizer

            apply_table_optimizer(run.user, cfg)
            model, constraints = run.user.module, run.user.constraints or {}
        else:
            model = build_model(
                cfg, table_sizes=data.table_sizes, feature_names=data.feature_names, zch=zch, num_dense=data.num_dense
            )
        from tpurec.dlrm import host_tier

        auto = host_tier.is_auto(o.host_tier)
        if o.host_tier and not auto:  # tables on the host tier, in the planner's words (tpurec/dlrm/host_tier.py)
            constraints = self._host_tier_constraints(model, constraints)
        plan = None
        if o.plan:
            from tpurec.planner.plan_io import load_plan

            plan = load_plan(o.plan)
        # --step compiled|pipelined take an EmbeddingCollection on its fixed-shape output path only
        # (tpurec/sharding/ec_preprocess.py): on CPU ranks too, with fixed limits; EBCs keep theirs
        fixed = True if o.step != "eager" and _holds_embedding_collection(model) else None
        try:
            # the --limits file is read and checked against the model by DMP (tpurec/sharding/dmp.py)
            self.dmp = shard(
                model,
                cfg,
                run.device,
                plan=plan,
                id_limits=o.id_limits,
                constraints=constraints,
                fixed_limits=fixed,
                host_tier="auto" if auto else None,
            )
        except PlanMismatchError as e:  # DMP says "the plan": name the file
            raise e.named(f"--plan {o.plan}") from None
        if o.dense_compiled(run.device, emulated=run.emulation.topology is not None):
            from tpurec.dlrm.training.dense_compile import compile_dense  # the embeddings stay eager

            names = compile_dense(self.dmp.module, run.device)
            why = "--compile-dense" if o.compile_dense else "on a TPU by default (--eager-dense keeps them eager)"
            run.say(f"{why}: {', '.join(names) or 'no dense module'} compiled")
        if auto:  # the tables the planner moved there: their caches' figures in the result line
            data.host_tier_tables = host_tier.planned_tables(self.dmp.plan)
            moved = ", ".join(data.host_tier_tables) or "no table (all fit the HBM)"
            run.say(f"--host-tier auto: {moved} on the host tier")
        if o.plan:  # after DMP's shard checks, as the launcher's preflight orders them
            from tpurec.planner.plan_check import check_plan_world
            from tpurec.planner.plan_io import read_doc

            check_plan_world(read_doc(o.plan), run.world, f"--plan {o.plan}")
        if zch is not None:
            from tpurec.dlrm.zch import RemapCounters

            self.remap = RemapCounters(zch).attach(self.dmp)
            run.say(
                f"--zch: {len(self.remap.tables)} managed-collision table(s) on this rank, {zch.eviction} eviction "
                f"every {zch.eviction_interval} steps"
            )
        elif run.remapped():
            self._count_model_remaps()

    def _host_tier_constraints(self, model: Any, constraints: dict | None) -> dict:
        """The planner's constraints with --host-tier's tables on the host tier: the model's own (a
        --model-module's), or the built-in DLRM's (model.planner_constraints)."""
        from tpurec.dlrm import host_tier
        from tpurec.dlrm.model import planner_constraints

        run = self.run
        assert run.options.host_tier is not None
        if run.user is not None:
            names = [t.name for t in run.user.tables]
        else:
            names = [c.name for c in model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()]
            constraints = planner_constraints(run.cfg, run.device, names)
        return host_tier.constraints(run.options.host_tier, names, constraints)

    def _zch_table_sizes(self, data: TrainingData) -> None:
        """--zch over several ranks: tables too small for a row-wise block of >= 2 rows on every rank
        grow to the smallest size that has one (tpurec.dlrm.zch.remap_rows), said in one line."""
        from tpurec.dlrm.zch import remap_rows

        run, world = self.run, self.run.world
        sizes = [remap_rows(n, world) for n in data.table_sizes]
        grown = [f"{t.name} {a} -> {b}" for t, a, b in zip(run.table_set.tables, data.table_sizes, sizes) if a != b]
        if grown:
            run.say(
                f"--zch at {world} ranks: every rank holds a row-wise block of every managed-collision table, "
                f"of >= 2 rows (one id and TorchRec's end marker); rows grown: {', '.join(grown)}"
            )
            data.table_sizes = sizes

    def _count_model_remaps(self) -> None:
        """A --model-module's own managed-collision tables: their remaps counted as --zch's are
        (tpurec.dlrm.zch.RemapCounters), said in one line with what they take."""
        from tpurec.dlrm.zch import RemapCounters

        user = self.run.user
        assert user is not None
        self.remap = remap = RemapCounters(None).attach(self.dmp)
        ranges = user.remap_ranges()
        said = ", ".join(f"{f} (ids below {n:,})" for f, n in ranges.items())
        eviction, interval = remap.policy()
        counted = (
            f"{len(remap.tables)} counted on this rank ({eviction} eviction every {interval} steps)"
            if remap.tables
            else "none counted"
        )
        uncounted = f"; not counted: {', '.join(remap.uncounted)} (not MCHManagedCollisionModule)"
        self.run.say(
            f"managed-collision tables of {user.target}: features {said} read unhashed for the remap; "
            f"{counted}{uncounted if remap.uncounted else ''}"
        )
        if not remap.tables:
            self.remap = None

    def report_plan(self, data: TrainingData, outputs: SideOutputs) -> None:
        """The plan's summary line (rank 0), and `--save-plan`'s file (one writer per host)."""
        import os

        run = self.run
        report = None
        try:
            if run.user is not None:
                report = plan_report_of(
                    self.dmp, run.user.tables, data.batch_size, run.table_optimizer(), run.model_name
                )
            else:
                report = plan_report(self.dmp, run.cfg, run.table_set, data.table_sizes, data.batch_size)
            run.say(plan_summary(report))
            mine = [d for d in report["devices"] if d.get("rank") == run.rank]
            self.planned_hbm_bytes = int(mine[0]["hbm_used_bytes"]) if mine else None
        except Exception as e:  # the summary is informative only; never fail a run on it
            run.say(f"(plan summary unavailable: {e})")
        # one writer per host (a later --plan reads it on every host)
        if run.options.save_plan and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            from tpurec.planner.plan_io import save_plan

            with outputs.kept():
                save_plan(self.dmp.plan, run.options.save_plan, report["meta"] if report else None, "--save-plan")
                run.say(f"plan saved to {run.options.save_plan}")
