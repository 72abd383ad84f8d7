import logging

# torchrec warns that our Topology is not built by its TopologyFactory; not actionable in tests.
logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
