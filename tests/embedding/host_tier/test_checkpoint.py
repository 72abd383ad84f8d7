"""Checkpoints between host-tier and all-resident runs: the whole table, coherent, both ways."""

from __future__ import annotations

import copy

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from torchrec.distributed.types import CacheParams

from tests.embedding.helpers import fused_optimizers

from . import training

CACHE = {"t0": CacheParams(load_factor=0.1, algorithm=CacheAlgorithm.LFU), "t2": CacheParams(load_factor=0.1)}
FIRST, THEN = 80, 60


def _save(model: training.Model) -> tuple[dict, dict, dict]:
    """(tables, fused optimizer state, dense head) as a checkpoint holds them: copies."""
    tables = {k: v.clone() for k, v in model.ebc.state_dict().items()}
    return tables, copy.deepcopy(model.ebc.fused_optimizer.state_dict()), copy.deepcopy(model.head.state_dict())


def _load(model: training.Model, saved: tuple[dict, dict, dict]) -> None:
    tables, optim, head = saved
    model.ebc.load_state_dict(tables)
    model.ebc.fused_optimizer.load_state_dict(optim)
    model.head.load_state_dict(head)


@pytest.mark.parametrize("direction", ["host_tier_to_resident", "resident_to_host_tier"])
def test_a_checkpoint_moves_between_tiers_and_training_goes_on_unchanged(direction):
    opt = fused_optimizers()["rowwise_adagrad"]
    data = training.batches(FIRST + THEN)
    straight = training.build(opt)  # the all-resident run, never interrupted
    straight_losses = training.train(straight, data)

    saves_from = training.build(opt, CACHE if direction == "host_tier_to_resident" else None)
    first_losses = training.train(saves_from, data[:FIRST])
    loads_into = training.build(opt, None if direction == "host_tier_to_resident" else CACHE)
    _load(loads_into, _save(saves_from))
    then_losses = training.train(loads_into, data[FIRST:])

    assert torch.equal(torch.cat([first_losses, then_losses]), straight_losses)
    want, got = training.tables_and_state(straight), training.tables_and_state(loads_into)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_the_state_dict_is_the_whole_table_and_its_views_load_in_place():
    """state_dict() gives each host-tier table whole ([rows, dim], cached rows written back); values
    written into those tensors in place (as torch.distributed.checkpoint loads) are what the next
    step reads, as with a resident table."""
    opt = fused_optimizers()["sgd"]
    data = training.batches(40)
    resident, tiered = training.build(opt), training.build(opt, CACHE)
    training.train(resident, data[:20])
    training.train(tiered, data[:20])
    assert tiered.ebc.kernel.host_tier["t0"].counters.misses > 0

    views = tiered.ebc.state_dict()
    assert views["embedding_bags.t0.weight"].shape == (1000, 8)
    assert views["embedding_bags.t2.weight"].shape == (2000, 16)
    assert len(tiered.ebc.kernel.host_tier["t0"].cached_rows()) == 0  # made whole: the cache emptied
    # a checkpoint of other values, loaded into the views in place, into both runs
    gen = torch.Generator().manual_seed(7)
    other = {k: torch.randn(v.shape, generator=gen) for k, v in views.items()}
    for k, v in views.items():
        v.copy_(other[k])
    tiered.ebc.load_state_dict(views)
    resident.ebc.load_state_dict(other)

    assert torch.equal(training.train(tiered, data[20:]), training.train(resident, data[20:]))
    want, got = training.tables_and_state(resident), training.tables_and_state(tiered)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_named_parameters_show_the_whole_tables():
    tiered = training.build(fused_optimizers()["sgd"], CACHE)
    shapes = {name: tuple(p.shape) for name, p in tiered.ebc.named_parameters()}
    assert shapes == {
        "embedding_bags.t0.weight": (1000, 8),
        "embedding_bags.t1.weight": (300, 8),
        "embedding_bags.t2.weight": (2000, 16),
    }
