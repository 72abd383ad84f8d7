"""The training worker: one process per rank. `tpurec train` runs it directly (one rank) or through
torch.distributed.run (--nproc N); multi-host jobs launch it with torchrun:

    torchrun --nnodes 2 --nproc-per-node 4 ... -m tpurec.dlrm.train --data DIR [flags of tpurec train]

Everything but the final JSON line goes to stderr, so stdout stays machine-readable.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("tpurec.train")


def _setup_logging(rank: int) -> None:
    # Our messages at INFO; everything else (fbgemm's "Successfully loaded" lines, torchrec, fx)
    # only from WARNING up, and torchrec's deprecation warnings not at all: the run's stderr is
    # meant to fit on a screen.
    import warnings

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s" if rank else "%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)
    for noisy in ("torchrec", "torch.fx", "torch.distributed", "fbgemm_gpu"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torchrec|fbgemm_gpu|torch)\b")


def _init_distributed(device: str = "cpu"):
    """(rank, world_size): from torchrun's environment, else a single process.

    On TPU the ranks talk through TorchTPU's `tpu_dist` backend (not yet run on TPU hardware);
    elsewhere through gloo.
    """
    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        from tpurec.device import tpu_status

        # Without a usable TPU, stay on gloo: the device check later names what is missing.
        dist.init_process_group("tpu_dist" if device == "tpu" and tpu_status().usable else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _resolve_device(name: str) -> str:
    from tpurec.device import tpu_status

    if name == "auto":
        return "tpu" if tpu_status().usable else "cpu"
    return name


def _infinite(reader):
    """The reader's batches epoch after epoch (the reader tracks its own epoch and position); the
    loop decides when to stop. An epoch without a batch ends the stream (never spin forever)."""
    while True:
        n = 0
        for n, batch in enumerate(reader, 1):
            yield batch
        if n == 0:
            return


def plan_report(dmp, cfg, table_sizes, batch_size) -> dict:
    """The inspector's report of the plan the DMP is running (also the meta `tpurec plan show` reads)."""
    from tpurec.catalog import TableSpec, get_table_set
    from tpurec.sharding.inspect import build_report

    ts = get_table_set(cfg.table_set)
    tables = [TableSpec(t.name, t.feature, n, t.embedding_dim, t.pooling_factor) for t, n in zip(ts.tables, table_sizes)]
    topo = dmp.topology
    return build_report(dmp.plan, tables, topo.spec, batch_size=batch_size, optimizer=cfg.embedding_optimizer,
                        compute_device=topo.compute_device, model=cfg.name)


def plan_summary(report: dict) -> str:
    """The inspector's text without the per-table list (one line per sharding instead): one screen."""
    from collections import Counter

    from tpurec.sharding.inspect import format_text

    text = format_text(report, top=3).split("\n")
    kinds = Counter(f"{t['sharding_type']} ({t['compute_kernel']})" for t in report["tables"])
    head = text[:3]
    devices = text[text.index("devices (GiB; ms)"):]
    devices = devices[:devices.index("")] if "" in devices else devices
    return "\n".join(head + [f"tables: {len(report['tables'])}: " + ", ".join(f"{n} {k}" for k, n in kinds.items())
                             + "  (per table: --save-plan P.json, then tpurec plan show P.json)"] + devices)


def _check_host_memory(cfg, sizes: list[int], world: int) -> None:
    """Refuse at once, in one line, tables that cannot fit in this host's free memory on CPU
    (criteo-kaggle / mlperf-dcnv2 are sized for TPU slices): better than an OOM kill mid-setup."""
    from tpurec.catalog import get_table_set

    dims = [t.embedding_dim for t in get_table_set(cfg.table_set).tables]
    per_row_state = {"sgd": lambda d: 0, "rowwise_adagrad": lambda d: 1, "adagrad": lambda d: d,
                     "adam": lambda d: 2 * d}[cfg.embedding_optimizer]
    total = sum(n * (d + per_row_state(d)) * 4 for n, d in zip(sizes, dims))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    need = total * local // max(1, world)  # this host's ranks hold their share of the tables
    free = _available_bytes()
    if free is None:
        return
    if need > 0.8 * free:
        raise ValueError(f"the {cfg.table_set} tables need {need / 2**30:.1f} GiB of weights and optimizer state on "
                         f"this host, which has {free / 2**30:.1f} GiB free; use --model dlrm-tiny, data converted "
                         f"with smaller tables (tpurec data convert --tables dlrm-tiny), more hosts, or a TPU")


def _available_bytes() -> int | None:
    """MemAvailable (free + reclaimable page cache) on Linux, else free pages, else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class MetricsLog:
    """Rows of training / eval figures, appended to a CSV or JSONL file as they come (rank 0)."""

    FIELDS = ["kind", "step", "epoch", "samples", "seconds", "loss", "samples_per_s", "auc", "ne", "logloss",
              "accuracy", "rows"]

    def __init__(self, path: str | None, append: bool):
        self.path = Path(path) if path else None
        self.records: list[dict] = []
        if self.path is None:
            return
        self.csv = self.path.suffix.lower() == ".csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if append and self.path.exists():
            self.records = self._read()
        else:
            self.path.write_text(",".join(self.FIELDS) + "\n" if self.csv else "")

    def _read(self) -> list[dict]:
        import csv

        if self.csv:
            with open(self.path) as f:
                return [{k: (float(v) if k not in ("kind",) and v != "" else v) for k, v in row.items()}
                        for row in csv.DictReader(f)]
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def add(self, rec: dict) -> None:
        self.records.append(rec)
        if self.path is None:
            return
        with open(self.path, "a") as f:
            if self.csv:
                f.write(",".join("" if rec.get(k) is None else str(rec.get(k)) for k in self.FIELDS) + "\n")
            else:
                f.write(json.dumps(rec) + "\n")


def evaluate(pipeline, dmp, readers) -> dict:
    """Forward the whole eval split through the (drained) pipeline; metrics over all ranks."""
    import torch

    from tpurec.dlrm import metrics

    from tpurec.dlrm.data import eval_batches

    dmp.eval()
    logits, labels = [], []
    it = eval_batches(readers.eval)
    with torch.no_grad():
        while True:
            try:
                _, lo, la = pipeline.progress(it)
            except StopIteration:
                break
            logits.append(lo)
            labels.append(la)
    dmp.train()
    lo = torch.cat(logits)[: readers.eval_rows]  # drop the padding of the last batch
    la = torch.cat(labels)[: readers.eval_rows]
    return metrics.compute(*metrics.gather(lo, la))


def run_training(args) -> int:
    """One rank's whole run; returns the process exit code."""
    import torch
    import torch.distributed as dist

    from tpurec.dlrm import checkpoint as ckpt
    from tpurec.dlrm.configs import get_config, override
    from tpurec.dlrm.data import ensure_synth, make_readers, model_table_sizes
    from tpurec.dlrm.model import LRSchedule, build_model, build_optimizer, shard
    from tpurec.catalog import get_table_set

    rank, world = _init_distributed(_resolve_device(args.device))
    _setup_logging(rank)
    # One thread per rank unless asked: on a small shared host more threads than free cores make
    # every op wait for a busy core (measured 20x slower with 2 threads on 2 busy cores).
    torch.set_num_threads(args.threads or 1)
    say = log.info if rank == 0 else (lambda *a, **k: None)

    cfg = override(get_config(args.model), batch_size=args.batch_size, steps=args.steps, epochs=args.epochs,
                   eval_every=args.eval_every, seed=args.seed, embedding_lr=args.embedding_lr,
                   dense_lr=args.dense_lr, synth_rows=args.synth_rows, eval_fraction=args.eval_fraction,
                   interaction=args.interaction)
    device = _resolve_device(args.device)

    # ---- data ----
    if args.data:
        data_dir = Path(args.data)
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if local_rank == 0:  # one writer per host; the others wait at the barrier
            data_dir = ensure_synth(cfg.table_set, cfg.synth_rows, cfg.seed, say=say)
        if world > 1:
            dist.barrier()
        from tpurec.dlrm.data import synth_dir

        data_dir = synth_dir(cfg.table_set, cfg.synth_rows, cfg.seed)
    from tpurec.data import dataset_metadata

    meta = dataset_metadata(data_dir)
    ts = get_table_set(cfg.table_set)
    sizes = model_table_sizes(data_dir, [t.num_embeddings for t in ts.tables])
    feature_names = [f["name"] for f in meta.get("sparse", [])]
    readers = make_readers(data_dir, cfg.batch_size, rank, world, seed=cfg.seed, eval_fraction=cfg.eval_fraction,
                           table_sizes=sizes, warn=log.warning if rank == 0 else (lambda *a: None))
    batch = readers.batch_size
    steps_per_epoch = len(readers.train)
    total_steps = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * steps_per_epoch))
    oracle = meta.get("oracle_auc")
    say(f"data: {data_dir}: {meta.get('rows', '?'):,} rows; per rank {readers.train.num_rows:,} train / "
        f"{readers.eval_rows:,} eval rows; {steps_per_epoch} steps per epoch of global batch {batch * world:,}"
        + (f"; oracle AUC {oracle:.4f}" if oracle else ""))

    if device == "cpu":
        _check_host_memory(cfg, sizes, world)

    # ---- model ----
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, table_sizes=sizes, feature_names=feature_names)
    plan = None
    if args.plan:
        from tpurec.sharding.plan_io import load_plan

        plan = load_plan(args.plan)
    dmp = shard(model, cfg, device, plan=plan)
    optimizer = build_optimizer(dmp, cfg)
    schedule = LRSchedule(optimizer, cfg.warmup_steps, cfg.decay_start, cfg.decay_steps)
    if rank == 0:
        report = None
        try:
            report = plan_report(dmp, cfg, sizes, batch)
            say(plan_summary(report))
        except Exception as e:  # the summary is informative only; never fail a run on it
            say(f"(plan summary unavailable: {e})")
        if args.save_plan:
            from tpurec.sharding.plan_io import save_plan

            save_plan(dmp.plan, args.save_plan, meta=report["meta"] if report else None)
            say(f"plan saved to {args.save_plan}")

    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device(device) if device == "cpu" else dmp.device)

    # ---- resume ----
    step, samples = 0, 0
    if args.resume:
        src = args.checkpoint_dir if args.resume == "latest" else args.resume
        if not src:
            raise ValueError("--resume needs --checkpoint-dir (or --resume PATH)")
        if args.resume == "latest" and ckpt.latest(src) is None:
            say(f"resume: no complete checkpoint in {src}; starting from scratch")
        else:
            cmeta, state = ckpt.load(src, dmp, optimizer)
            step, samples = int(cmeta["step"]), int(cmeta.get("samples", 0))
            if state is not None:
                readers.train.load_state_dict(state["reader"])
                ckpt.set_rng_state(state["rng"])
                how = "exact (same world size)"
            else:
                # Another world size: rows are dealt out differently, so continue at the same epoch and
                # the same fraction of it (rows near the cut may be seen twice or skipped in that epoch).
                st = readers.train.state_dict()
                frac = float(cmeta.get("epoch_fraction", 0.0))
                st.update(epoch=int(cmeta.get("epoch", 0)),
                          rows_consumed=int(frac * readers.train.num_rows) // batch * batch)
                readers.train.load_state_dict(st)
                how = (f"at world size {world} from {cmeta['world_size']}: data position approximate "
                       f"(epoch {st['epoch']}, {frac:.1%} through it)")
            say(f"resume: {cmeta['path']} at step {step}, {how}")

    # ---- loop ----
    mlog = MetricsLog(args.metrics_out if rank == 0 else None, append=bool(args.resume) and step > 0)
    ckpt_every = args.checkpoint_every if args.checkpoint_every is not None else cfg.eval_every
    stream = _infinite(readers.train)
    positions: list[dict] = []  # reader state after each batch the pipeline pulled in this segment

    def tracked(n):
        for b in itertools.islice(stream, n):
            positions.append(readers.train.state_dict())
            yield b

    from tqdm import tqdm

    bar = tqdm(total=total_steps, initial=step, unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=rank != 0 or args.quiet, mininterval=0.5, smoothing=0.1)
    t_start = time.perf_counter()
    train_seconds, steps_run, last_eval = 0.0, 0, None
    log_every = max(1, min(50, total_steps // 100 or 1))
    loss_sum, loss_n = 0.0, 0

    def boundary(s: int) -> bool:
        return s == total_steps or (cfg.eval_every and s % cfg.eval_every == 0) or \
            bool(args.checkpoint_dir and ckpt_every and s % ckpt_every == 0)

    def save(s: int) -> None:
        st = readers.train.state_dict()
        cmeta = {"step": s, "samples": samples, "world_size": world, "batch_size": batch, "epoch": st["epoch"],
                 "epoch_fraction": st["rows_consumed"] / max(1, readers.train.num_rows), "config": cfg.to_dict(),
                 "data": str(data_dir)}
        path = ckpt.save(args.checkpoint_dir, s, dmp, optimizer, {"reader": st, "rng": ckpt.rng_state(), "step": s},
                         cmeta, keep=args.keep)
        say(f"checkpoint: {path}")

    while step < total_steps:
        # A segment runs to the next eval / checkpoint / end; the pipeline drains at its end, so the
        # reader position then is exactly that of the batches trained (nothing in flight).
        seg_end = next(s for s in range(step + 1, total_steps + 1) if boundary(s))
        positions.clear()
        it = tracked(seg_end - step)
        t0 = time.perf_counter()
        while True:
            schedule.set_step(step)
            try:
                loss, _, _ = pipeline.progress(it)
            except StopIteration:
                break
            step += 1
            steps_run += 1
            samples += batch * world
            loss_sum += float(loss)
            loss_n += 1
            if step % log_every == 0 or step == seg_end:
                elapsed = train_seconds + time.perf_counter() - t0
                sps = steps_run * batch * world / elapsed if elapsed > 0 else 0.0
                mlog.add({"kind": "train", "step": step, "epoch": readers.train.epoch, "samples": samples,
                          "seconds": round(time.perf_counter() - t_start, 3), "loss": loss_sum / loss_n,
                          "samples_per_s": round(sps, 1)})
                bar.set_postfix_str(f"loss {loss_sum / loss_n:.4f}, {sps:,.0f} samples/s", refresh=False)
                loss_sum, loss_n = 0.0, 0
            bar.update(1)
        train_seconds += time.perf_counter() - t0
        if step < seg_end:  # the data ran out (an empty epoch); cannot continue
            raise RuntimeError(f"training data exhausted at step {step}")
        if cfg.eval_every and step % cfg.eval_every == 0 and step != total_steps:
            last_eval = evaluate(pipeline, dmp, readers)
            mlog.add({"kind": "eval", "step": step, "epoch": readers.train.epoch, "samples": samples,
                      "seconds": round(time.perf_counter() - t_start, 3), **last_eval})
            if rank == 0:
                bar.write(f"step {step}: eval AUC {last_eval['auc']:.4f}, NE {last_eval['ne']:.4f}, "
                          f"logloss {last_eval['logloss']:.4f}", file=sys.stderr)
        if args.checkpoint_dir and ckpt_every and step % ckpt_every == 0 and step != total_steps:
            save(step)
    bar.close()

    final = evaluate(pipeline, dmp, readers)
    mlog.add({"kind": "eval", "step": step, "epoch": readers.train.epoch, "samples": samples,
              "seconds": round(time.perf_counter() - t_start, 3), **final})
    if args.checkpoint_dir:
        save(step)
    sps = steps_run * batch * world / train_seconds if train_seconds > 0 else 0.0
    result = {"steps": step, "auc": round(final["auc"], 6), "ne": round(final["ne"], 6),
              "logloss": round(final["logloss"], 6), "accuracy": round(final["accuracy"], 6),
              "samples_per_s": round(sps, 1), "eval_rows": final["rows"], "world_size": world,
              "batch_size": batch, "model": cfg.name, "seconds": round(time.perf_counter() - t_start, 2)}
    if oracle:
        result["oracle_auc"] = oracle
    if rank == 0:
        if args.metrics_out:
            from tpurec.dlrm.plots import plot_curves

            png = Path(args.metrics_out).with_suffix(".png")
            plot_curves(mlog.records, png, title=f"{cfg.name}, {world} rank(s), batch {batch}/rank",
                        oracle_auc=oracle)
            say(f"metrics: {args.metrics_out}, curves: {png}")
        say(summary_text(result, data_dir))
        print(json.dumps(result), flush=True)
    return 0


def summary_text(r: dict, data_dir) -> str:
    lines = [
        "",
        f"tpurec train: {r['model']} on {r['world_size']} rank(s), batch {r['batch_size']}/rank, data {data_dir}",
        f"  steps          {r['steps']:,}   ({r['seconds']:.1f} s wall)",
        f"  throughput     {r['samples_per_s']:,.0f} samples/s",
        f"  eval AUC       {r['auc']:.4f}" + (f"   (oracle {r['oracle_auc']:.4f}, gap {r['oracle_auc'] - r['auc']:+.4f})"
                                              if r.get("oracle_auc") else ""),
        f"  eval NE        {r['ne']:.4f}   logloss {r['logloss']:.4f}   accuracy {r['accuracy']:.4f}"
        f"   ({r['eval_rows']:,} rows)",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Entry point of `python -m tpurec.dlrm.train` (what torchrun launches on every rank)."""
    import argparse

    from tpurec.dlrm.cli import add_arguments, run_worker

    p = argparse.ArgumentParser(prog="python -m tpurec.dlrm.train",
                                description="one rank of `tpurec train` (launch with torchrun)")
    add_arguments(p)
    return run_worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
