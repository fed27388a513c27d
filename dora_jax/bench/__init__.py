"""Benchmarks that write JSON: `python -m dora_jax.bench {engine,modes,convergence}`."""
