"""Every `tpurec bench` benchmark, with the one timer (`timer`) and workload generator (`workloads`) they share.

Layer 4: benchmarks may import any part of tpurec, and nothing in tpurec imports them. The package
itself imports nothing, so registering `tpurec bench` (`tpurec.bench.cli`) stays light.
"""
