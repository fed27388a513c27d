"""The composition root: the run config, what a run builds (build, cold_start), the one training
loop, the embedded run (runner), slice supervision, checkpoints, fault injection and metrics."""
