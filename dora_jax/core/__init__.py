"""The JAX-free vocabulary every layer shares: records (requests, trajectories, groups, batches),
modes (the policy table) and window (the C3 arithmetic)."""
