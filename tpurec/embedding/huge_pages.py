"""Host tables on transparent huge pages: a table larger than the TLB's reach turns every random
lookup and update into a page walk besides the cache miss.

With 4 KiB pages a 256 MB table spans 65k pages and a lookup of a random row misses the TLB as well
as the cache; on 2 MiB pages it spans 128. Linux gives a mapping huge pages where it is asked to
(`madvise(MADV_HUGEPAGE)`, honoured when /sys/kernel/mm/transparent_hugepage/enabled is "always" or
"madvise", the usual defaults), so a table's storage is advised before its first write: the pages
it then faults in are huge. Measured here (1M x 64 float32, 2048 random lookups, torch's
`embedding_bag`): 113 us on 4 KiB pages, 76-78 us on huge ones. torch can do the same for every
allocation of a process (the THP_MEM_ALLOC_ENABLE=1 environment variable, read by c10's CPU
allocator); this asks it for the tables alone.

Elsewhere (not Linux, a table under MIN_BYTES, TPUREC_NO_HUGE_PAGES=1, or a refusal), the storage
is torch's ordinary one: the advice changes speed, never contents.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

from tpurec.runtime.device import DeviceKind

HUGE_PAGE = 2 << 20  # bytes in an x86-64 / arm64 transparent huge page (Linux's default PMD size)
MIN_BYTES = 8 << 20  # smaller tables mostly fit the TLB's reach; not worth a 2 MiB granule
# Linux's <asm-generic/mman-common.h> value, which Python's mmap module names where it knows it
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def filled(shape: tuple[int, ...], value: float, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.full(shape, value), its storage advised onto huge pages first where that applies."""
    dev = torch.device(device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if dev.type != DeviceKind.CPU or nbytes < MIN_BYTES or not _enabled():
        return torch.full(shape, value, dtype=dtype, device=dev)
    out = torch.empty(shape, dtype=dtype)
    advise(out)
    return out.fill_(value)  # the first write: the pages are faulted in now, huge where granted


def move_onto(t: torch.Tensor) -> bool:
    """`t`'s values into new memory advised onto huge pages before its first write, `t` taking that
    storage (`set_`: the same tensor object, so whatever reads `t` later reads the new memory; views
    made before keep the old). For tensors allocated elsewhere, such as a benchmark peer's tables
    (tpurec/bench/contenders.py). Whether it moved (same rules as `filled`)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != DeviceKind.CPU or nbytes < MIN_BYTES or not _enabled() or not t.is_contiguous():
        return False
    new = torch.empty_like(t)
    if not advise(new):
        return False
    with torch.no_grad():
        new.copy_(t)  # the first write: the pages are faulted in now, huge where granted
        t.set_(new.untyped_storage(), new.storage_offset(), new.size(), new.stride())
    return True


def advise(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB granules of t's memory; whether Linux accepted."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    libc = _libc()
    if libc is None:
        return False
    return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE) == 0


def _enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("TPUREC_NO_HUGE_PAGES", "") in ("", "0")


_LIBC: list[ctypes.CDLL | None] = []


def _libc() -> ctypes.CDLL | None:
    if not _LIBC:
        try:
            lib: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
            assert lib is not None
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            lib.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            lib = None
        _LIBC.append(lib)
    return _LIBC[0]
