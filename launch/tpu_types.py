"""Known Cloud TPU accelerator types: chips, hosts, default runtime version and zones.

A table to extend: it holds the generations this project targets (v4, v5e as `v5litepod-N`, v5p,
v6e), as the Cloud TPU "regions and zones" and per-generation pages listed them when written
(2026-11). A type or zone missing here is refused before any gcloud call; add a row (or a zone) to
`GENERATIONS` when Google adds one.

Naming: for v4 and v5p the suffix counts TensorCores (2 per chip: `v5p-64` is 32 chips on 8 hosts);
for v5e and v6e it counts chips (`v5litepod-8` is 8 chips on one host).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation's family of accelerator types `<prefix>-<size>`."""

    prefix: str  # accelerator type prefix: "v5p", "v5litepod", ...
    sizes: tuple[int, ...]  # allowed suffixes
    cores_per_chip: int  # 2 where the suffix counts TensorCores (v4, v5p), 1 where it counts chips
    chips_per_host: int  # chips on each host of a multi-host slice
    max_single_host_chips: int  # the largest slice that is one host (its chips all on one VM)
    runtime_version: str  # default `--version` / `--runtime-version`
    zones: tuple[str, ...]  # zones that offer this generation


GENERATIONS: tuple[Generation, ...] = (
    Generation(
        "v4", (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), 2, 4, 4, "tpu-ubuntu2204-base", ("us-central2-b",)
    ),
    Generation(
        "v5litepod",
        (1, 4, 8, 16, 32, 64, 128, 256),
        1,
        4,
        8,
        "v2-alpha-tpuv5-lite",
        ("us-central1-a", "us-south1-a", "us-west1-c", "us-west4-a", "europe-west4-b", "asia-southeast1-b"),
    ),
    Generation(
        "v5p",
        (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
        2,
        4,
        4,
        "v2-alpha-tpuv5",
        ("us-central1-a", "us-east5-a", "europe-west4-b"),
    ),
    Generation(
        "v6e",
        (1, 4, 8, 16, 32, 64, 128, 256),
        1,
        4,
        8,
        "v2-alpha-tpuv6e",
        (
            "us-central1-b",
            "us-east1-d",
            "us-east5-a",
            "us-east5-b",
            "europe-west4-a",
            "asia-northeast1-b",
            "southamerica-east1-c",
        ),
    ),
)

# Names people write that gcloud does not accept, and what gcloud calls them.
_ALIASES = {"v5e": "v5litepod"}


@dataclasses.dataclass(frozen=True)
class TpuType:
    """One accelerator type, e.g. `v5p-32`: 16 chips on 4 hosts."""

    name: str
    generation: str  # the prefix: "v5p", "v5litepod", ...
    chips: int
    hosts: int
    runtime_version: str
    zones: tuple[str, ...]

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts


def known_types() -> tuple[str, ...]:
    return tuple(f"{g.prefix}-{size}" for g in GENERATIONS for size in g.sizes)


def lookup(name: str, field: str) -> TpuType:
    """The `TpuType` called `name`; a ValueError naming `field` if the table does not know it."""
    prefix, _, suffix = name.rpartition("-")
    for g in GENERATIONS:
        if prefix == g.prefix and suffix.isdigit() and int(suffix) in g.sizes:
            chips = int(suffix) // g.cores_per_chip
            hosts = 1 if chips <= g.max_single_host_chips else chips // g.chips_per_host
            return TpuType(name, g.prefix, chips, hosts, g.runtime_version, g.zones)
    hint = ""
    if prefix in _ALIASES:
        hint = f" (gcloud calls it {_ALIASES[prefix]}-{suffix})"
    else:
        for g in GENERATIONS:
            if prefix == g.prefix:
                hint = f" ({g.prefix} sizes: {', '.join(str(s) for s in g.sizes)})"
    families = ", ".join(f"{g.prefix}-{{{','.join(str(s) for s in g.sizes)}}}" for g in GENERATIONS)
    raise ValueError(
        f"{field}={name!r} is not a known TPU accelerator type{hint}; known: {families}. "
        "The table is launch/tpu_types.py GENERATIONS: extend it if Google offers more."
    )


def check_zone(tpu: TpuType, zone: str, field: str, zone_field: str) -> None:
    """A ValueError naming both fields if `zone` does not offer `tpu`'s generation."""
    if zone not in tpu.zones:
        raise ValueError(
            f"{zone_field}={zone!r} does not offer {field}={tpu.name!r}; {tpu.generation} zones: "
            f"{', '.join(tpu.zones)} (launch/tpu_types.py GENERATIONS, a table to extend)"
        )
