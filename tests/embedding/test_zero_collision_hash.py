"""tpurec's host insert of FBGEMM's multi-probe zero-collision hash (tpurec/embedding/zero_collision_hash.py),
against oracles of its own: FBGEMM's CPU hash and readonly lookup, and small cases worked out by hand from
the CUDA kernel's algorithm (first slot = murmur hash % bucket size, then the next slots, circularly)."""

from __future__ import annotations

import pytest
import torch

fbgemm_gpu = pytest.importorskip("fbgemm_gpu")

from tpurec.embedding.zero_collision_hash import EMPTY, murmur_hash3_2x64, zero_collision_hash  # noqa: E402

SLOTS = 8


def _fbgemm_hash(x: int) -> int | None:
    """FBGEMM's own murmur_hash3 (its CPU op returns an int64: None for hashes of 2**63 and up)."""
    try:
        return int(torch.ops.fbgemm.murmur_hash3(torch.tensor([x]), 0, 0))
    except RuntimeError:
        return None


def _ids_with_first_slot(slot: int, count: int, modulo: int = SLOTS) -> list[int]:
    """Ids whose first slot (FBGEMM's hash % modulo) is `slot`, by FBGEMM's hash."""
    out: list[int] = []
    x = 1
    while len(out) < count:
        h = _fbgemm_hash(x)
        if h is not None and h % modulo == slot:
            out.append(x)
        x += 1
    return out


def _table(slots: int = SLOTS, evict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.fbgemm.create_zch_buffer(slots, support_evict=evict, device=torch.device("cpu"), long_type=True)


def _lookup(ids: torch.Tensor, identities: torch.Tensor, max_probe: int, **kw) -> torch.Tensor:
    out, _ = torch.ops.fbgemm.zero_collision_hash(
        input=ids, identities=identities, max_probe=max_probe, circular_probe=True, readonly=True, **kw
    )
    return out


def test_the_hash_is_fbgemms():
    seen = 0
    for x in range(300):
        want = _fbgemm_hash(x)
        if want is not None:
            assert int(murmur_hash3_2x64(x, 0, 0)) == want
            seen += 1
    assert seen > 100


def test_colliding_new_ids_take_the_next_slots_circularly_then_fall_back():
    a, b, c, d = _ids_with_first_slot(6, 4)
    (e,) = _ids_with_first_slot(7, 1)
    identities, _ = _table()
    out, evicted = zero_collision_hash(torch.tensor([a, b, a, c, d, e]), identities, max_probe=3, circular_probe=True)
    # a: 6; b: 6 taken -> 7; a again: its own 6; c: 6, 7 taken -> 0 (circular); d: 6, 7, 0 taken, 3 probes
    # spent -> falls back to its first slot 6 (a collision, nothing written); e: 7 taken, 0 taken -> 1
    assert out.tolist() == [6, 7, 6, 0, 6, 1]
    assert evicted is None
    assert identities[:, 0].tolist() == [c, e, EMPTY, EMPTY, EMPTY, EMPTY, a, b]
    # FBGEMM's readonly lookup finds every inserted id where the insert put it
    assert _lookup(torch.tensor([a, b, c, e]), identities, 3).tolist() == [6, 7, 0, 1]
    out, _ = zero_collision_hash(torch.tensor([d]), identities, max_probe=5, circular_probe=True)
    assert out.tolist() == [2]  # 6, 7, 0, 1 taken: a 5th probe reaches the empty slot 2


def test_bucketed_inserts_stay_in_their_bucket_and_fbgemm_finds_them():
    """TorchRec's sharded module passes each id its bucket's size and start (`local_sizes`, `offsets`)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10**12, (300,), generator=gen)
    identities, _ = _table(64)
    bucket = ids % 2
    sizes, offsets = torch.full_like(ids, 32), bucket * 32
    out, _ = zero_collision_hash(ids, identities, 5, True, local_sizes=sizes, offsets=offsets)
    assert bool(((out >= offsets) & (out < offsets + 32)).all())
    held = identities[out, 0] == ids  # the rest fell back (their buckets are full)
    assert int(held.sum()) == 64 and int((identities != EMPTY).sum()) == 64
    look = _lookup(ids, identities, 5, local_sizes=sizes, offsets=offsets)
    assert torch.equal(look[held], out[held])


def test_ttl_eviction_takes_the_first_expired_slot_of_a_new_id():
    """Eviction policy 0 with metadata (TorchRec's TTL policies): a slot is taken over when its
    metadata is below both the threshold and the new id's."""
    a, p, q = _ids_with_first_slot(5, 3)
    for threshold, want, evicted_slots in ((15, 5, [5]), (5, 7, [])):
        identities, metadata = _table(evict=True)
        identities[5, 0], identities[6, 0] = p, q
        metadata[5, 0], metadata[6, 0] = 10, 20
        out, evicted = zero_collision_hash(
            torch.tensor([a]), identities, 4, True, metadata=metadata,
            input_metadata=torch.tensor([30], dtype=torch.int32), eviction_threshold=threshold,
        )  # fmt: skip
        # threshold 15: slot 5 (metadata 10) expired -> a replaces p there; threshold 5: nothing expired,
        # a goes to the first empty slot, 7
        assert out.tolist() == [want] and evicted.tolist() == evicted_slots
        assert identities[want, 0] == a and metadata[want, 0] == 30
    # an id already in its probe range is never moved by an eviction
    identities, metadata = _table(evict=True)
    identities[5, 0], identities[6, 0] = p, a
    metadata[5, 0], metadata[6, 0] = 10, 12
    out, evicted = zero_collision_hash(
        torch.tensor([a]), identities, 4, True, metadata=metadata,
        input_metadata=torch.tensor([30], dtype=torch.int32), eviction_threshold=15,
    )  # fmt: skip
    assert out.tolist() == [6] and evicted.tolist() == [] and metadata[6, 0] == 30 and identities[5, 0] == p


def test_lru_eviction_takes_the_oldest_slot_of_the_probe_range():
    """Eviction policy 1: an id that finds neither itself nor an empty slot takes the probed slot seen
    longest ago (below the threshold and its own metadata), then locks it for the rest of the call."""
    a, b, p, q, r = _ids_with_first_slot(5, 5)
    identities, metadata = _table(evict=True)
    for slot, (ident, hour) in zip((5, 6, 7), ((p, 12), (q, 8), (r, 9))):
        identities[slot, 0], metadata[slot, 0] = ident, hour
    identities[0, 0], metadata[0, 0] = 99, 14  # the range's 4th slot (circular): also full
    out, evicted = zero_collision_hash(
        torch.tensor([a, b]), identities, 4, True, metadata=metadata,
        input_metadata=torch.tensor([30, 30], dtype=torch.int32), eviction_threshold=15, eviction_policy=1,
    )  # fmt: skip
    # a: slots 5, 6, 7, 0 all taken; oldest hour 8 at slot 6 -> a there. b: oldest is now 9 at slot 7
    assert out.tolist() == [6, 7] and evicted.tolist() == [6, 7]
    assert identities[:, 0].tolist()[5:] == [p, a, b] and metadata[:, 0].tolist()[5:] == [12, 30, 30]
    assert _lookup(torch.tensor([a, b]), identities, 4).tolist() == [6, 7]


def test_a_readonly_call_is_fbgemms_lookup_and_changes_nothing():
    a, b = _ids_with_first_slot(2, 2)
    identities, _ = _table()
    identities[2, 0] = a
    before = identities.clone()
    out, _ = zero_collision_hash(torch.tensor([a, b]), identities, 3, True, readonly=True)
    assert out.tolist() == [2, 2]  # b: not found in 3 probes, its first slot
    assert torch.equal(identities, before)


@pytest.mark.parametrize("policy", [0, 1])
def test_a_slot_exactly_at_the_eviction_threshold_is_kept(policy):
    """A slot is evicted only when its metadata is below the threshold: at it, it is kept (both policies),
    one hour below, it is taken."""
    a, p = _ids_with_first_slot(5, 2)
    for threshold, want, evicted_slots in ((10, 6, []), (11, 5, [5])):
        identities, metadata = _table(evict=True)
        identities[5, 0], metadata[5, 0] = p, 10
        out, evicted = zero_collision_hash(
            torch.tensor([a]), identities, 2 if policy == 0 else 1, True, metadata=metadata,
            input_metadata=torch.tensor([30], dtype=torch.int32), eviction_threshold=threshold,
            eviction_policy=policy,
        )  # fmt: skip
        # policy 0 (2 probes): kept -> the empty slot 6; policy 1 (1 probe): kept -> a falls back to its
        # first slot 5 without taking it (p stays there)
        kept = threshold == 10
        assert out.tolist() == [want if policy == 0 or not kept else 5], threshold
        assert evicted.tolist() == evicted_slots, threshold
        assert identities[5, 0] == (p if kept else a) and metadata[5, 0] == (10 if kept else 30), threshold


def test_an_id_finds_its_own_slot_wrapping_around_its_probe_block_not_the_table():
    """With reserved slots (opt_in_prob) the probe block is the table less the reserved slots: an id whose
    first slot is the block's last finds itself at the block's first slot, and so stays there even when
    its draw would opt it out (an id not found goes to a reserved slot)."""
    (a,) = _ids_with_first_slot(5, 1, modulo=6)  # block 6 of 8 slots, 2 reserved (6, 7)
    (p,) = _ids_with_first_slot(1, 1, modulo=6)  # any other id
    identities, _ = _table()
    identities[5, 0], identities[0, 0] = p, a  # a's first slot 5 is taken; a sits at 0 (wrapped)
    out, _ = zero_collision_hash(
        torch.tensor([a]), identities, 3, True, opt_in_prob=50, num_reserved_slots=2,
        opt_in_rands=torch.tensor([99], dtype=torch.int32),
    )  # fmt: skip
    assert out.tolist() == [0]
    assert identities[:, 0].tolist() == [a, EMPTY, EMPTY, EMPTY, EMPTY, p, EMPTY, EMPTY]
