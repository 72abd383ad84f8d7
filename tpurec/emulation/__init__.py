"""A TPU slice on this machine: every rank of a slice runs tpurec's TPU code path on the CPU.

`tpurec train --emulate-tpu v5p-16` starts the slice's ranks grouped into hosts as on Cloud TPU
(one torch.distributed.run agent per host, `LOCAL_WORLD_SIZE` = chips per host), with the launch
environment TorchTPU wants decided in the parent (`launch_env`). In each rank (`rank.activate`):

* TorchTPU's SparseCore ops are the stand-in of `torchtpu_ops` (TorchTPU 0.2.0's schemas, the CPU
  reference underneath, every call's compile key recorded), reached through tpurec's real TPU
  adapter (`tpurec.embedding.tpu`);
* `torch.tpu`, the `tpu_dist` process-group backend and DDP's parameter check follow TorchTPU
  0.2.0's rules (`torchtpu_dist`);
* `torch.compile(..., backend="tpu")` is TorchTPU's backend name: the graph runs on the CPU data, and
  each run asks the device for the programs TorchTPU's compiler would make of it (`compiled`);
* every TPU-path decision tpurec makes (fixed id limits, the chip's SparseCore count, float32 tables,
  the `cpu:gloo,tpu:tpu_dist` group, planning for the slice) is taken as on the TPU
  (`tpurec.runtime.device.tpu_path`).

What it cannot show: anything of the chip itself (speed, memory, XLA's compilation). Device tensors
are `device.TpuTensor`s over CPU data, under TorchTPU's device rules. docs/tpu.md lists each rule and
the TorchTPU source it was read from.
"""
