"""The jax-free core: plan data, matching, leaves, resolution, lowering and cost.

Nothing here imports jax, flax or Lark: a plan checks against a shapes file on any machine.
"""
