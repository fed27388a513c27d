"""Rollout: the JetStream-API engine over our decoder, per-slot sampling, and the per-slice
continuous-batching worker that turns Requests into Trajectories."""
