"""`tpurec bench tpu-train --cpu`: the smoke run CI can do, and the plain-JAX contender's own checks
(the figures come from a TPU: docs/results.md)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("jax")

from tpurec.bench.tpu_train import CPU_DIMS  # noqa: E402
from tpurec.bench.tpu_train_shapes import V5E_HBM_GIB, workload  # noqa: E402
from tpurec.bench.tpu_train_split import PHASES  # noqa: E402
from tpurec.cli import main  # noqa: E402


@pytest.mark.slow  # 28 s: two trainings through the CLI; the JAX model's learning test stays in the default suite
def test_the_cpu_smoke_run_reports_both_contenders_and_their_ratio(capsys):
    assert main(["bench", "tpu-train", "--cpu", "--json", "--seed", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["seed"] == 3 and doc["device"] == "cpu" and doc["platform"] == "cpu"
    assert len(doc["load_average"]["before"]) == 3 and len(doc["load_average"]["after"]) == 3
    w = doc["workload"]
    assert (w["tables"], w["rows_cap"], w["batch"], w["ids_per_sample"]) == (26, 300, 64, 214)
    assert max(w["rows"]) == 300 and w["rows_total"] == sum(w["rows"]) and w["timed_steps"] == 3
    [rnd] = doc["rounds"]
    assert sorted(rnd["order"]) == ["jax", "split", "tpurec"]
    pieces = doc["summary"]["split"]
    assert pieces["sum_ms"] == pytest.approx(sum(pieces[k] for k in PHASES), abs=0.01) and pieces["update_ms"] > 0
    assert pieces["device_ms"] == pytest.approx(pieces["sum_ms"] - pieces["host_ms"], abs=0.01)
    # medians of the parts: near their steps' sums, each part timed
    assert pieces["host_build_ms"] > 0 and pieces["host_copy_ms"] > 0
    assert pieces["host_build_ms"] + pieces["host_copy_ms"] == pytest.approx(pieces["host_ms"], rel=0.5)
    assert pieces["device_busy_at_most"] == pytest.approx(pieces["device_ms"] / pieces["step_ms"], abs=2e-3)
    jax_side, ours = rnd["jax"], rnd["tpurec"]
    assert jax_side["platform"] == "cpu" and len(jax_side["losses"]) == 2 + 3
    assert ours["steps_timed"] == 3 and "--model mlperf-dcnv2" in ours["command"]
    assert "--embedding-optimizer rowwise_adagrad" in ours["command"] and "--device cpu" in ours["command"]
    s = doc["summary"]
    assert s["jax"]["samples_per_s"] > 0 and s["tpurec"]["samples_per_s"] > 0
    # the ratio is tpurec's samples/s over JAX's, from the step times of the same round
    assert s["ratio_tpurec_vs_jax"]["ratio"] == pytest.approx(jax_side["step_ms"] / ours["step_ms"], rel=1e-3)
    # the split's device pieces over tpurec train's step (#59's chip-busy share), at most 1
    share = min(1.0, pieces["device_ms"] / s["tpurec"]["step_ms"])
    assert s["device_share_of_train_step"] == pytest.approx(share, abs=1e-3)
    # the JAX side's tables and state: f32 rows of dim 16 and one accumulator per row
    assert doc["hbm_jax"]["table_bytes"] == sum(w["rows"]) * (16 + 1) * 4 and doc["hbm_jax"]["memory"] is None


def test_off_a_tpu_without_cpu_it_is_one_line(capsys):
    assert main(["bench", "tpu-train", "--contenders", "jax"]) == 2
    assert "JAX sees no TPU here (its backend: cpu)" in capsys.readouterr().err


def test_a_cap_over_the_budget_is_refused(capsys):
    assert main(["bench", "tpu-train", "--rows-cap", "3000000"]) == 2
    assert "over the 8 GiB" in capsys.readouterr().err


def test_the_jax_model_learns_a_learnable_target():
    """20 steps on 4 batches whose label is a function of one feature's ids: the loss must fall far
    below log 2, where a model that learns nothing stays (with both learning rates 0 the same steps
    give 0.68-0.71). The model's first 4 tables (C1..C4), not its 26: the jitted step holds each
    table's lookup and update, unrolled, and 26 tables took 30 s of CPU compiling and initialising
    (38 s in all) for no more of the learning checked; the 26 run in the CLI smoke test (make test-all)."""
    from tpurec.bench.tpu_train_jax import host_batches, train

    full = workload(300, 64)
    w = dataclasses.replace(full, **CPU_DIMS, rows=full.rows[:4], hots=full.hots[:4], embedding_lr=0.1, dense_lr=0.01)
    batches = host_batches(w, 4)
    for b in batches:
        first_ids = b["ids"][0].reshape(64, w.hots[0])[:, 0]
        b["labels"] = (first_ids % 2).astype(np.float32)  # feature C1's first id decides the label
    out = train(w, batches, warmup=4, steps=16)
    losses = out["losses"]
    assert len(losses) == 20 and out["feed"] == "host"
    assert losses[0] > 0.6 and np.mean(losses[-4:]) < 0.25, losses
    # the batches put on the device once instead: the same steps on the same data, the same losses
    assert train(w, batches, warmup=4, steps=16, feed="device")["losses"] == losses


def test_row_wise_adagrad_sums_duplicate_ids_first():
    """The sparse update equals the dense reference: each row's gradient summed over its occurrences,
    then acc += mean(g^2) and row -= lr g / (sqrt(acc) + eps); untouched rows stay as they were."""
    import jax.numpy as jnp

    from tpurec.bench.tpu_train_jax_step import rowwise_adagrad

    rng = np.random.default_rng(0)
    table, acc = rng.normal(size=(7, 4)).astype(np.float32), rng.random(7).astype(np.float32)
    ids = np.array([3, 1, 3, 3, 6, 1], np.int32)
    grads = rng.normal(size=(6, 4)).astype(np.float32)
    t, a, i, g = (jnp.asarray(x) for x in (table, acc, ids, grads))
    new_t, new_acc = rowwise_adagrad(t, a, i, g, 0.1, 1e-8)
    summed = np.zeros_like(table)
    np.add.at(summed, ids, grads)
    want_acc = acc + (summed * summed).mean(axis=1) * (np.bincount(ids, minlength=7) > 0)
    want_t = table - 0.1 * summed / (np.sqrt(want_acc) + 1e-8)[:, None]
    np.testing.assert_allclose(np.asarray(new_acc), want_acc, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(new_t), want_t, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_full_size_jax_step_fits_a_v5e_by_xla_s_own_count():
    """The chip's step (16,384 x 214 ids, 2M-row caps) compiled for CPU, never run: parameters and state
    are donated (the outputs alias them) and arguments plus temporaries stay under a v5e's HBM. A TPU's
    layouts pad some arrays more than a CPU's; XLA's CPU count when written: 6.44 GiB of arguments,
    4.69 GiB of temporaries (11.1 of 15.7 GiB)."""
    import jax
    import jax.numpy as jnp

    from tpurec.bench.tpu_train_jax_model import init_params
    from tpurec.bench.tpu_train_jax_step import init_state, jitted_step

    w = workload(2_000_000, 16_384)
    params = jax.eval_shape(lambda: init_params(w, jax.random.key(0)))
    state = jax.eval_shape(init_state, params)
    batch = {
        "ids": [jax.ShapeDtypeStruct((w.batch * h,), jnp.int32) for h in w.hots],
        "dense": jax.ShapeDtypeStruct((w.batch, w.num_dense), jnp.float32),
        "labels": jax.ShapeDtypeStruct((w.batch,), jnp.float32),
    }
    mem = jitted_step(w).lower(params, state, batch).compile().memory_analysis()
    assert mem.alias_size_in_bytes >= w.table_bytes()  # donated: updated in place, not copied
    assert mem.argument_size_in_bytes + mem.temp_size_in_bytes < V5E_HBM_GIB * 2**30


def test_the_split_step_does_the_whole_step_s_work():
    """The split contender drains the device between pieces; the pieces are still one training step:
    after 2 steps its tables and dense weights are the undrained step's, and each piece is timed."""
    import torch

    from tpurec.bench.tpu_train_jax import host_batches
    from tpurec.bench.tpu_train_split import Step, split_step

    w = dataclasses.replace(workload(300, 64), **CPU_DIMS)
    batches = host_batches(w, 2)
    split, whole = Step(w, batches, torch.device("cpu")), Step(w, batches, torch.device("cpu"))
    drained, readings = [], iter(range(100, 200))
    for i in range(2):
        times, held = split_step(split, i, lambda t: None, lambda: next(readings))
        drained.append(times)
        whole.whole(i)
        # the device's bytes in use read once after each piece, in the step's order
        assert held == {p: 100 + 5 * i + k for k, p in enumerate(PHASES)}
    assert all(set(d) == {*PHASES, "host_build_ms", "host_copy_ms"} and min(d.values()) > 0 for d in drained)
    assert all(d["host_ms"] == d["host_build_ms"] + d["host_copy_ms"] for d in drained)
    # the stacks' rows (padded to the partitions) and one row-wise Adagrad float a row
    assert sum(w.rows) * (16 + 1) * 4 <= split.table_state_bytes() < 1.2 * sum(w.rows) * (16 + 1) * 4
    for t in ("t0", "t9", "t25"):
        assert torch.equal(split.ebc.kernel.read_weight(t), whole.ebc.kernel.read_weight(t)), t
    for (name, a), b in zip(split.dense.named_parameters(), whole.dense.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(
        split.ebc.kernel.read_weight("t0"), Step(w, batches, torch.device("cpu")).ebc.kernel.read_weight("t0")
    )


def test_the_split_step_with_compiled_arches_trains_as_the_eager_one(monkeypatch):
    """TPUREC_SPLIT_COMPILE_DENSE=1 (the default on a TPU): the arches' forward and the dense update
    compiled (aot_eager on a CPU), the same weights after 2 steps, bit for bit."""
    import torch

    from tpurec.bench.tpu_train_jax import host_batches
    from tpurec.bench.tpu_train_split import COMPILE_DENSE_ENV, Step

    w = dataclasses.replace(workload(300, 64), **CPU_DIMS)
    batches = host_batches(w, 2)
    eager = Step(w, batches, torch.device("cpu"))
    monkeypatch.setenv(COMPILE_DENSE_ENV, "1")
    compiled = Step(w, batches, torch.device("cpu"))
    assert "_torchdynamo_orig_callable" in dir(compiled.dense["over"].forward)
    assert "step" in vars(compiled.opt) and "step" not in vars(eager.opt)  # the compiled update in its place
    for i in range(2):
        assert torch.equal(compiled.whole(i), eager.whole(i))
    for (name, a), b in zip(compiled.dense.named_parameters(), eager.dense.parameters()):
        assert torch.equal(a, b), name


def test_a_compiled_step_asked_for_gets_limits_measured_for_this_chip():
    """--tpurec-args with --step compiled/pipelined and no --limits: the bench measures them with
    `tpurec data stats` for one device of the chip it sees; on a chip it cannot name, one line."""
    from tpurec.bench.tpu_train import _measure_limits, _step_of
    from tpurec.errors import UserError

    assert _step_of([]) == "eager" and _step_of(["--step", "compiled", "--x"]) == "compiled"
    assert _step_of(["--step=pipelined"]) == "pipelined" and _step_of(["--step"]) == "eager"
    w = workload(300, 64)
    with pytest.raises(UserError, match=r"^on a TPU v4 give the id limits: --tpurec-args='--step S --limits L.json'"):
        _measure_limits(w, "/nowhere", "TPU v4", {}, "/tmp")


def test_tpurec_logs_at_the_warmup_s_end_and_the_run_s_and_seldom_between():
    """Each logged step reads the loss back (the host waits for the device): the bench asks for the two
    records it times between, and at most one every 10 steps (not tpurec train's every step below 200)."""
    from tpurec.bench.tpu_train_tpurec import train_args

    w = workload(300, 64)

    def every(warmup, timed):
        args = train_args(w, "D", warmup + timed, "tpu", "M", 8, warmup)
        return int(args[args.index("--log-every") + 1])

    assert every(10, 50) == 10 and every(5, 20) == 5 and every(4, 8) == 2 and every(2, 3) == 1
    assert every(0, 30) == 10


def test_tables_on_the_host_tier_leave_the_chip_s_budget():
    """MLPerf's five 40M-row tables capped at 10M (26 GiB in all) fit the bench's budget only when they
    are on the host tier (--tpurec-args' --host-tier, tpurec alone); a table it does not have is named."""
    import argparse

    from tpurec.bench.tpu_train import _settings
    from tpurec.errors import UserError

    big = ("t_C1", "t_C10", "t_C20", "t_C21", "t_C22")
    with pytest.raises(UserError, match=r"resident tables' weights and state take 26\.04 GiB"):
        workload(10_000_000, 16_384)
    w = workload(10_000_000, 16_384, host_tier=big)
    assert round(w.table_bytes() / 2**30, 2) == 26.04
    assert w.table_bytes(resident=True) == (sum(w.rows) - 5 * 10**7) * 129 * 4
    with pytest.raises(UserError, match=r"^--host-tier names t_C27: the tables are t_C1 \.\. t_C26$"):
        workload(300, 64, host_tier=("t_C27",))

    def settings(contenders, extra):
        ns = argparse.Namespace(cpu=False, rows_cap=10_000_000, batch=None, warmup=None, steps=None, rounds=None)
        return _settings(argparse.Namespace(**vars(ns), contenders=contenders, tpurec_args=extra))

    w, *_ = settings("tpurec", "--host-tier=t_C1:0.2,t_C10:0.2,t_C20,t_C21:0.2:lfu,t_C22 --step eager")
    assert w.host_tier == big and w.describe()["host_tier"] == list(big)
    with pytest.raises(UserError, match=r"only tpurec keeps tables in host memory; give --contenders tpurec$"):
        settings("jax,tpurec", "--host-tier t_C1")


def test_tables_out_writes_the_workloads_tables_for_the_planner(tmp_path, capsys):
    # the chip's measured HBM against the planner's figure for the same tables, offline: the file is a
    # `tpurec plan --tables` file of the capped MLPerf tables, each table's rows and multi-hot size
    out = tmp_path / "tables.json"
    assert main(["bench", "tpu-train", "--rows-cap", "50000", "--tables-out", str(out)]) == 0
    assert "wrote 26 tables" in capsys.readouterr().out
    tables = json.loads(out.read_text())
    w = workload(50_000, 16_384)
    assert [t["rows"] for t in tables] == list(w.rows) and [t["pooling_factor"] for t in tables] == list(w.hots)
    assert {t["dim"] for t in tables} == {w.dim} and tables[20]["features"] == ["C21"]
    plan = tmp_path / "plan.json"
    args = ["--topology", "v5e-1", "--batch-size", "16384", "--optimizer", "rowwise_adagrad"]
    assert main(["plan", "--tables", str(out), *args, "--format", "json", "--out", str(plan)]) == 0
    (device,) = json.loads(plan.read_text())["devices"]
    assert device["hbm_used_bytes"] > w.table_bytes()  # the weights and state, and the step's buffers beside
