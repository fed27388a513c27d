"""The control plane, plain Python (no JAX): the coordinator (supply, switching, the version
window), the orchestrator (a pure planner), the transfer queue, the ledger, the auditor and the
RolloutPort seam."""
