"""The insert of FBGEMM's multi-probe zero-collision hash (`fbgemm::zero_collision_hash`, TorchRec's
`HashZchManagedCollisionModule`) on the host: what fbgemm-gpu-cpu lacks (its CPU kernel only looks ids
up, `readonly`).

Written from FBGEMM's CUDA kernel (`fbgemm_gpu/src/faster_hash_ops/faster_hash.cu`, `process_item_zch`,
and `common_utils.cuh`; main as of 2026-08-21, the kernel unchanged since 2026-05-04), one id after
another in input order. For each id, as there:

- its first slot is `murmur_hash3_2x64(id, 0, 0) % block` (block: the id's bucket size, `local_sizes`,
  less the reserved slots with opt-in), its identity the id itself (int64 identities);
- it probes up to `max_probe` slots, `(slot + 1) % block`, taking the first slot that holds the id or is
  empty (`-1`); each slot it takes gets metadata = max(metadata, the id's `input_metadata`) and, with
  `runtime_meta`, a use counted;
- eviction policy 0 with metadata (TorchRec's TTL policies): an id found nowhere in its probe range (an
  empty slot ends that search) takes instead the first probed slot whose metadata is below both the
  eviction threshold and its own metadata; policy 1 (LRU): an id that finds neither itself nor an empty
  slot takes the probed slot with the oldest such metadata, which it locks for the rest of the call
  (as the CUDA kernel's `process_lock`, which a later id that finds its slot does not release);
- opt-in (`opt_in_rands` below `opt_in_prob`): a new id not opted in goes to a reserved slot;
- an id with no slot falls back to its first slot (`hash % local size`), or -1 with `disable_fallback`;
- the evicted slots are returned sorted and unique (`_unique` of those != -1), or None without eviction.

The CUDA kernel runs the ids on parallel threads with atomic compare-and-swap: when two new ids of one
batch probe the same empty slot, the one whose swap lands first takes it, so a batch's slots can differ
between CUDA runs. Without eviction every CUDA outcome is that of some order of the ids (slots only go
from empty to taken); this is the outcome of input order. The kernel's spin on a taken slot whose
metadata is still -1 (written by another thread a moment later) never happens one id at a time; a slot
whose metadata is -1 with an identity in it (state from elsewhere) is never evicted here (CUDA would spin).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from tpurec.runtime.device import DeviceKind

EMPTY = -1  # FBGEMM's kDefaultTensor: an empty slot, unset metadata, an unlocked slot
_MAX_IDENTITY = 2**31 - 1  # kMaxIdentityNum: identities of another dtype than the ids are id % this
_MAX_HOURS = 2**31 - 1
_U64 = np.uint64


@numba.njit(cache=True, nogil=True)
def _rotl(x: Any, r: int) -> Any:
    return (x << _U64(r)) | (x >> _U64(64 - r))


@numba.njit(cache=True, nogil=True)
def _fmix(k: Any) -> Any:
    k ^= k >> _U64(33)
    k *= _U64(0xFF51AFD7ED558CCD)
    k ^= k >> _U64(33)
    k *= _U64(0xC4CEB9FE1A85EC53)
    k ^= k >> _U64(33)
    return k


@numba.njit(cache=True, nogil=True)
def murmur_hash3_2x64(x: Any, y: Any, seed: Any) -> Any:
    """MurmurHash3 x64-128 of two 64-bit blocks, halves xor-ed (FBGEMM's `murmur_hash3_2x64`), as uint64."""
    c1 = _U64(0x87C37B91114253D5)
    c2 = _U64(0x4CF5AD432745937F)
    h1 = _U64(seed)
    h2 = _U64(seed)
    k1 = _U64(x) * c1
    k1 = _rotl(k1, 31) * c2
    h1 ^= k1
    h1 = _rotl(h1, 27) + h2
    h1 = h1 * _U64(5) + _U64(0x52DCE729)
    k2 = _U64(y) * c2
    k2 = _rotl(k2, 33) * c1
    h2 ^= k2
    h2 = _rotl(h2, 31) + h1
    h2 = h2 * _U64(5) + _U64(0x38495AB5)
    h1 ^= _U64(16)
    h2 ^= _U64(16)
    h1 += h2
    h2 += h1
    h1 = _fmix(h1)
    h2 = _fmix(h2)
    h1 += h2
    h2 += h1
    return h1 ^ h2


@numba.njit(cache=True, nogil=True)
def _umod(h: Any, m: Any) -> Any:
    return np.int64(h % _U64(m))  # C++: uint64 % int64 is unsigned


@numba.njit(cache=True, nogil=True)
def _insert(
    values: Any,
    identities: Any,
    hash_identity: bool,
    max_probe: int,
    modulo: int,
    local_sizes: Any,
    offsets: Any,
    has_offsets: bool,
    metadata: Any,
    has_metadata: bool,
    input_metadata: Any,
    has_input_metadata: bool,
    cur_hour: int,
    eviction_threshold: int,
    policy: int,
    disable_fallback: bool,
    opt_in_prob: int,
    num_reserved: int,
    rands: Any,
    has_rands: bool,
    runtime_meta: Any,
    count_uses: bool,
    lock: Any,
    output: Any,
    evicted: Any,
) -> None:
    for i in range(values.shape[0]):
        item = values[i]
        size = local_sizes[i] if has_offsets else modulo
        offset = offsets[i] if has_offsets else np.int64(0)
        meta_val = input_metadata[i] if has_input_metadata else cur_hour
        h = murmur_hash3_2x64(item, 0, 0)
        block = size if opt_in_prob == -1 else size - num_reserved
        idx: Any = _umod(h, block)
        identity = item % _MAX_IDENTITY if hash_identity else item
        # the id's own slot in its probe range (an empty slot ends the search): no eviction for it then
        found: Any = np.int64(-1)
        j, left = idx, max_probe
        while left > 0:
            left -= 1
            seen = identities[j + offset]
            if seen == EMPTY:
                break
            if seen == identity:
                found = j
                break
            j = (j + 1) % block
        opt_in = True
        if found == -1 and has_rands and rands[i] >= opt_in_prob:
            opt_in = False
            idx = block + _umod(h, num_reserved)
            if has_metadata:
                metadata[idx + offset] = max(metadata[idx + offset], meta_val)
                if policy == 1:
                    lock[idx + offset] = EMPTY
        probes = max_probe
        min_index: Any = np.int64(-1)
        min_hours, min_identity = _MAX_HOURS, np.int64(EMPTY)
        while True:
            more = probes > 0
            probes -= 1  # `while (max_probe_local-- > 0 && opt_in)`
            if not (more and opt_in):
                break
            slot = idx + offset
            old = identities[slot]
            if old == EMPTY or old == identity:
                identities[slot] = identity
                if has_metadata:
                    metadata[slot] = max(metadata[slot], meta_val)
                    if policy == 1:
                        lock[slot] = EMPTY
                if count_uses:
                    runtime_meta[slot] += 1
                break
            if has_metadata and policy == 0:
                md = metadata[slot]
                if found == -1 and md != EMPTY and md < meta_val and eviction_threshold > md:
                    identities[slot] = identity
                    evicted[i] = slot
                    metadata[slot] = max(md, meta_val)
                    if count_uses:
                        runtime_meta[slot] = 1
                    break
            elif has_metadata and policy == 1:
                last = metadata[slot]
                if last != EMPTY and eviction_threshold > last and min_hours > last and last < meta_val:
                    if lock[slot] == EMPTY:
                        lock[slot] = i
                        if min_index != -1 and lock[min_index + offset] == i:
                            lock[min_index + offset] = EMPTY
                        min_index, min_hours, min_identity = idx, last, old
            idx = (idx + 1) % block
        if probes < 0:
            if min_index == -1:
                if disable_fallback:
                    output[i] = -1
                    continue
                idx = _umod(h, size) if opt_in_prob == -1 else block + _umod(h, num_reserved)
            else:
                idx = min_index
                slot = idx + offset
                if identities[slot] == min_identity:
                    identities[slot] = identity
                metadata[slot] = max(metadata[slot], meta_val)
                lock[slot] = EMPTY
                evicted[i] = slot
                if count_uses:
                    runtime_meta[slot] = 1
        output[i] = idx + offset


def _array(t: Any, dtype: Any) -> npt.NDArray[Any]:
    return np.zeros(1, dtype) if t is None else t.numpy().reshape(-1)


def zero_collision_hash(
    input: Any,
    identities: Any,
    max_probe: int,
    circular_probe: bool = False,
    exp_hours: int = -1,
    readonly: bool = False,
    local_sizes: Any = None,
    offsets: Any = None,
    metadata: Any = None,
    output_on_uvm: bool = False,
    disable_fallback: bool = False,
    _modulo_identity_DPRECATED: bool = False,  # noqa: N803  (the op's own spelling)
    input_metadata: Any = None,
    eviction_threshold: int = -1,
    eviction_policy: int = 0,
    opt_in_prob: int = -1,
    num_reserved_slots: int = -1,
    opt_in_rands: Any = None,
    runtime_meta: Any = None,
) -> tuple[Any, Any]:
    """`torch.ops.fbgemm.zero_collision_hash` with the CUDA kernel's insert, on host tensors: the same
    arguments and checks as its CUDA entry point; `identities`, `metadata`, `runtime_meta` updated in
    place. A readonly call goes to FBGEMM's own CPU kernel."""
    import time

    import torch

    if readonly:
        return torch.ops.fbgemm.zero_collision_hash(
            input=input, identities=identities, max_probe=max_probe, circular_probe=circular_probe,
            exp_hours=exp_hours, readonly=True, local_sizes=local_sizes, offsets=offsets, metadata=metadata,
            output_on_uvm=output_on_uvm, disable_fallback=disable_fallback,
            _modulo_identity_DPRECATED=_modulo_identity_DPRECATED, input_metadata=input_metadata,
            eviction_threshold=eviction_threshold, eviction_policy=eviction_policy, opt_in_prob=opt_in_prob,
            num_reserved_slots=num_reserved_slots, opt_in_rands=opt_in_rands, runtime_meta=runtime_meta,
        )  # fmt: skip
    if not circular_probe or _modulo_identity_DPRECATED or output_on_uvm:
        raise ValueError("zero_collision_hash: circular_probe must be true, the deprecated options false")
    if identities.dim() != 2 or input.dim() != 1:
        raise ValueError("zero_collision_hash: identities [slots, 1], input 1-D")
    if input.dtype == torch.int32 and identities.dtype != torch.int32:
        raise ValueError("zero_collision_hash: int32 ids need int32 identities")
    if input_metadata is not None and (exp_hours != -1 or eviction_threshold == -1 or eviction_policy not in (0, 1)):
        raise ValueError("zero_collision_hash: input_metadata needs an eviction threshold and policy 0 or 1")
    if eviction_threshold != -1 and input_metadata is None:
        raise ValueError("zero_collision_hash: an eviction threshold needs input_metadata")
    cur_hour = (int(time.time()) // 3600) % _MAX_HOURS
    if exp_hours > 0:
        eviction_threshold = cur_hour - exp_hours
    evicting = eviction_threshold > 0 or eviction_policy > 0
    if evicting != (metadata is not None):
        raise ValueError(f"zero_collision_hash: eviction {'needs' if evicting else 'takes no'} metadata")
    if opt_in_prob != -1 and not (0 < opt_in_prob <= 100 and num_reserved_slots > 0):
        raise ValueError("zero_collision_hash: opt_in_prob in (0, 100] with reserved slots")
    for t in (input, identities, local_sizes, offsets, metadata, input_metadata, opt_in_rands, runtime_meta):
        if t is not None and (t.device.type != DeviceKind.CPU or not t.is_contiguous()):
            raise ValueError("zero_collision_hash: contiguous host tensors only")
    n = int(input.numel())
    output = torch.empty(n, dtype=torch.int64)
    evicted = torch.full((n,), EMPTY, dtype=torch.int64)
    if n:
        slots = int(identities.shape[0])
        has_offsets = local_sizes is not None
        _insert(
            input.numpy(),
            identities.numpy().reshape(-1),  # a view: updated in place
            identities.dtype != input.dtype,
            int(max_probe),
            slots,
            _array(local_sizes, np.int64),
            _array(offsets, np.int64),
            has_offsets,
            _array(metadata, np.int32),
            metadata is not None,
            _array(input_metadata, np.int32),
            input_metadata is not None,
            cur_hour,
            int(eviction_threshold),
            int(eviction_policy),
            bool(disable_fallback),
            int(opt_in_prob),
            int(num_reserved_slots),
            _array(opt_in_rands, np.int32),
            opt_in_rands is not None,
            _array(runtime_meta, np.int64),
            runtime_meta is not None,
            np.full(slots if eviction_policy == 1 and metadata is not None else 1, EMPTY, np.int32),
            output.numpy(),
            evicted.numpy(),
        )
    if not evicting:
        return output, None
    return output, torch.unique(evicted[evicted != EMPTY])
