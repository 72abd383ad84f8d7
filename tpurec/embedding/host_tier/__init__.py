"""The host tier: a table and its optimizer state in host memory, a cache of its rows in the kernel.

TorchRec's `fused_uvm_caching` on a TPU (docs/host_tier.md). Its parts, one job each:

* `params.py`: how many rows the cache holds and which rows leave first, from TorchRec's CacheParams;
* `policy.py`: LRU and LFU victim choice (`lru_queue.py`: LRU's queue of slots by last use);
  `slot_map.py`: which row each cache slot holds;
* `host_rows.py`: the whole table and its optimizer state in host memory, and rows copied with their
  state; `device_copies.py`: those copies in a few fixed shapes where the cache is on a TPU;
* `table_tier.py`: one table's cache: a batch's ids to slots, loads, write-backs, flushes, counters;
* `kjt_remap.py`: a KeyedJaggedTensor's ids turned into cache slots;
* `kernel.py`: `HostTierKernel`, the SparseCore kernel whose host-tier tables are those caches.

Nothing here is imported by the package: modules import the submodule that holds a name.
"""
