"""The runtime: everything that imports jax (pytrees, meshes, placement, steps, backends,
the live view, checkpoints, multi-process runs, generation).

This package's ``__init__`` imports nothing, so ``shardplan.runtime.devices`` can set up
simulated devices before jax loads.
"""
