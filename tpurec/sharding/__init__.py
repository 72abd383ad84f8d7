"""TorchRec at run time: sharders, sharded EBC/EC and their lookups, fused optimizer, DistributedModelParallel."""
