"""8 simulated CPU devices, set before jax is imported."""

from shardplan.runtime.devices import simulate

simulate(8)
