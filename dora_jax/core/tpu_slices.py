"""TPU accelerator types (`v5p-32`, `v5litepod-8`, `v6e-16`, gcloud's names) as slices: their chips
and physical topology, as GKE's `gke-tpu-topology` label and Ray's TPU slice placement groups name
it. Plain data, no JAX: the Ray placement (`dora_jax/cli/launch_ray.py`) and the cluster files
(`launch/ray_cluster.py`) read it; which types gcloud offers where is `launch/tpu_types.py`."""

from __future__ import annotations

# Generation prefix -> TensorCores per chip: v4 and v5p type suffixes count TensorCores (2 per
# chip: `v5p-32` is 16 chips), v5e (`v5litepod`) and v6e suffixes count chips.
CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5litepod": 1, "v6e": 1}

# Chips -> topology: 3-D tori for v4 and v5p, 2-D for v5e and v6e.
TOPOLOGY_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
    4096: "16x16x16",
}
TOPOLOGY_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


def generation_and_chips(tpu_type: str, field: str) -> tuple[str, int]:
    """("v5p", 16) for "v5p-32"; a ValueError naming `field` for a name of no known generation."""
    prefix, _, suffix = tpu_type.rpartition("-")
    if prefix not in CORES_PER_CHIP or not suffix.isdigit() or int(suffix) % CORES_PER_CHIP[prefix]:
        raise ValueError(
            f"{field}={tpu_type!r} is not a TPU accelerator type; expected <generation>-<size> with a generation of "
            f"{', '.join(CORES_PER_CHIP)} (e.g. v5p-32, v5litepod-8, v6e-16)"
        )
    return prefix, int(suffix) // CORES_PER_CHIP[prefix]


def topology(tpu_type: str, field: str = "tpu_type") -> str:
    """The chip topology of `tpu_type`: "2x2x4" for v5p-32 (16 chips), "4x4" for v6e-16."""
    generation, chips = generation_and_chips(tpu_type, field)
    table = TOPOLOGY_3D if CORES_PER_CHIP[generation] == 2 else TOPOLOGY_2D
    if chips not in table:
        raise ValueError(f"{field}={tpu_type!r}: no standard topology for {chips} chips; known: {sorted(table)}")
    return table[chips]
