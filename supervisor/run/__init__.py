"""Processes, files and backends: shim, process tree, ownership, limits, log follower, GPUs, Slurm."""
