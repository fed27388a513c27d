"""A durable tier with the writer's newest versions also kept in its own memory.

The trainer role publishes every version to the tensorstore tier (durable, on local disk or
gs://, read by the rollout slices and after a restart) and then recomputes behaviour log-probs
with the versions it published itself up to K steps ago (C3). Read back from the tensorstore tier,
every step would restore those versions from disk or GCS on the critical path (for 7B in bf16,
15 GB per version). `RecentTier` writes through to the durable tier and keeps the newest `keep`
versions in an `InProcessTier` (the newest on device, older ones in host memory), so those reads
are one host-to-device copy at most; older versions, and versions this process did not write,
come from the durable tier.

With a durable tier that writes in the background (`TensorStoreTier(background_writes=True)`),
`write` costs the trainer one on-device copy and the start of the durable write: the version is
served from memory at once (the durable tier lists it to its writer while it is being written), and
the rollout slices that read the durable tier wait for its commit. `flush()` waits for it.
"""

from __future__ import annotations

from dora_jax.store.in_process import InProcessTier
from dora_jax.store.param_store import Params, Shardings, Tier


class RecentTier:
    def __init__(self, durable: Tier, keep: int, device_versions: int = 1):
        if keep < 1:
            raise ValueError(f"RecentTier(keep={keep}); expected >= 1 (versions kept in memory)")
        self._durable = durable
        self._near = InProcessTier(device_versions=device_versions)
        self._keep = keep

    @property
    def durable(self) -> Tier:
        return self._durable

    def write(self, version: int, params: Params) -> None:
        self._near.write(version, params)  # our own copy: the trainer donates `params` to its next step
        try:
            self._durable.write(version, self._near.stored(version))
        except BaseException:
            self._near.delete(version)
            raise
        for old in self._near.versions()[: -self._keep]:
            self._near.delete(old)

    def flush(self) -> None:
        """Waits until every version written here is durable (a no-op for a synchronous tier)."""
        flush = getattr(self._durable, "flush", None)
        if flush is not None:
            flush()

    def read(self, version: int, shardings: Shardings, *, copy: bool = True) -> Params:
        if version in self._near.versions():
            return self._near.read(version, shardings, copy=copy)
        return self._durable.read(version, shardings, copy=copy)

    def delete(self, version: int) -> None:
        self._near.delete(version)
        self._durable.delete(version)

    def versions(self) -> tuple[int, ...]:
        return self._durable.versions()

    def bytes_by_tier(self) -> dict[str, int]:
        near = self._near.bytes_by_tier()
        return {**self._durable.bytes_by_tier(), "memory_device": near["device"], "memory_host": near["host"]}

    def __getattr__(self, name: str):  # the durable tier's own API (root, ...)
        if name.startswith("_"):  # (before __init__ has run, e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self._durable, name)
