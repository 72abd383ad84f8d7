"""Where tables go and what it costs: TPU slices, cost model, search, plan files, reports, measured id limits."""
