"""Launching a program's ranks on a TPU slice, real or emulated: `tpurec launch` (`cli`), one
torch.distributed.run agent per host (`hosts`), each ending in one line (`agent`). `tpurec train`
launches its ranks through it too; nothing here knows what the ranks run.
"""
