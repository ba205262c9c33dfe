"""Backends that apply a plan: auto (device_put + XLA) and shard_map."""
