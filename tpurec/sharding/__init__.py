"""TorchRec integration: sharder, DistributedModelParallel wrapper, TPU topology and planner."""
