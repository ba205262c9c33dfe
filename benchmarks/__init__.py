"""shardplan's benchmarks: `python -m benchmarks [--quick]` (see benchmarks/run.py)."""
