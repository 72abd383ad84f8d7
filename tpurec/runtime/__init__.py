"""Process and host plumbing: device, process groups, heartbeat, threads, locks, signals, host copies."""
