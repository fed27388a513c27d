"""The JAX-free vocabulary every layer shares: records (requests, trajectories, groups, batches),
modes (the policy table) and window (the C3 arithmetic); and fs, the file-system seam every file of
a run goes through (local or gs://), with object_log, appends on GCS."""
