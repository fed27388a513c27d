"""The control plane, plain Python (no JAX): the coordinator (supply, switching, the version
window) and its parts (groups in flight, rewards awaiting a score, evaluation rounds, the snapshot
format), the pure planners (orchestrator, switching, legacy fill), the transfer queue, the ledger,
the auditor and the RolloutPort seam."""
