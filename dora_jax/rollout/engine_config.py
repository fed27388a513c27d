"""The rollout engine's static sizes (`EngineConfig`: every field a compile-time shape) and the
checks of a request's sampling parameters against them."""

from __future__ import annotations

import dataclasses

from dora_jax.core.records import SamplingParams


class KVPoolTooSmall(ValueError):
    """The chip memory left after the weights holds too few KV pages for one request."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine sizes; every field is a compile-time shape."""

    num_slots: int = 8  # B: concurrent decodes (JetStream's max_concurrent_decodes)
    cache_length: int = 256  # S: prompt + response tokens one slot can hold
    max_prefill_length: int = 128  # largest prefill bucket; a power of two
    min_prefill_bucket: int = 16  # smallest prefill bucket; a power of two
    default_sampling: SamplingParams = SamplingParams(temperature=0.0)  # when a call passes none
    # Top-k / top-p filtering compiled into prefill and generate. Its sort and cumsum over the
    # vocabulary cost the TPU compiler ~20 s per program (Qwen's 152K vocabulary); off, requests
    # asking for a filter are refused. RolloutSpec.engine_config turns it on when the run's
    # sampling filters.
    sampling_filters: bool = True
    # Paged KV cache (dora_jax.models.paged): rows per page, a power of two up to
    # min_prefill_bucket dividing cache_length; 0 = the dense cache (every slot holds
    # cache_length rows whatever its length).
    page_size: int = 0
    # Pages in the pool, the scratch page included. Fewer pages than every slot at cache_length
    # hold more slots at the same memory: a request is admitted when its pages are free, and the
    # youngest is preempted when the pool runs dry. 0 = sized by the engine: `kv_memory_fraction`
    # of the chip memory left after the served weights, capped at every slot full (which is also
    # the size where the chip's memory is unknown, as on CPU).
    num_pages: int = 0
    kv_memory_fraction: float = 0.8
    # Most prompts one batched prefill program takes (a power of two; 1 = one prompt per prefill,
    # as JetStream's API). A batch's prompts are padded to one bucket and take at most
    # max_prefill_length tokens together (count x bucket), as the largest single prefill does.
    max_prefill_batch: int = 32

    def __post_init__(self):
        for name in ("max_prefill_length", "min_prefill_bucket", "max_prefill_batch"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"engine.{name}={value}; expected a power of two")
        if self.min_prefill_bucket > self.max_prefill_length:
            raise ValueError(
                f"engine.min_prefill_bucket={self.min_prefill_bucket} > max_prefill_length={self.max_prefill_length}"
            )
        if self.max_prefill_length > self.cache_length:
            raise ValueError(f"engine.max_prefill_length={self.max_prefill_length} > cache_length={self.cache_length}")
        if self.num_slots < 1:
            raise ValueError(f"engine.num_slots={self.num_slots}; expected >= 1")
        if self.page_size:
            ps = self.page_size
            if ps < 1 or ps & (ps - 1) or ps > self.min_prefill_bucket or self.cache_length % ps:
                raise ValueError(
                    f"engine.page_size={ps}; expected 0 (dense) or a power of two <= min_prefill_bucket="
                    f"{self.min_prefill_bucket} dividing cache_length={self.cache_length}"
                )
            if self.num_pages and self.num_pages - 1 < self.pages_per_slot:
                raise ValueError(
                    f"engine.num_pages={self.num_pages} gives {self.num_pages - 1} pages of page_size={ps} rows "
                    f"(page 0 is scratch); one request at cache_length={self.cache_length} needs "
                    f"{self.pages_per_slot}: expected 0 (every slot full) or >= {self.pages_per_slot + 1}"
                )
        elif self.num_pages:
            raise ValueError(f"engine.num_pages={self.num_pages} without engine.page_size; expected a page_size")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"engine.kv_memory_fraction={self.kv_memory_fraction}; expected 0 < fraction <= 1")

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def pages_per_slot(self) -> int:
        """M: the page-table width (cache_length rows)."""
        return self.cache_length // self.page_size if self.paged else 0

    @property
    def pool_pages(self) -> int:
        """Pages in the pool, the scratch page included."""
        if not self.paged:
            return 0
        return self.num_pages or self.num_slots * self.pages_per_slot + 1

    @property
    def live_page_buckets(self) -> tuple[int, ...]:
        """Page-table widths `generate` is compiled for: powers of two up to M, and M (the
        reference attention's work follows the longest live slot, not cache_length)."""
        sizes, size = [], 1
        while size < self.pages_per_slot:
            sizes.append(size)
            size *= 2
        return tuple(sizes) + (self.pages_per_slot,)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        sizes, size = [], self.min_prefill_bucket
        while size <= self.max_prefill_length:
            sizes.append(size)
            size *= 2
        return tuple(sizes)

    def prefill_chunks(self, length: int) -> tuple[int, ...]:
        """How `prefill` takes `length` tokens: chunks of `max_prefill_length`, each appended to the
        last one's prefix (`existing_prefix`); the final chunk is padded to its bucket, and that must
        fit the cache. ValueError naming the numbers if it does not."""
        if length < 1:
            raise ValueError(f"{length} tokens to prefill; expected >= 1")
        whole, last = divmod(length, self.max_prefill_length)
        chunks = (self.max_prefill_length,) * whole + ((last,) if last else ())
        start = length - chunks[-1]
        bucket = next(b for b in self.prefill_buckets if b >= chunks[-1])
        if start + bucket > self.cache_length:
            raise ValueError(
                f"{length} tokens prefill in chunks of max_prefill_length={self.max_prefill_length}; "
                f"the last ({chunks[-1]} tokens, padded to {bucket}) after {start} overflows "
                f"cache_length={self.cache_length}"
            )
        return chunks

    @property
    def prefill_batches(self) -> tuple[tuple[int, int], ...]:
        """(count C, bucket T) of every batched prefill program: C a power of two from 2 to
        `max_prefill_batch` (and to the slots rounded up to a power of two), C x T <=
        max_prefill_length."""
        widest = min(self.max_prefill_batch, 1 << (self.num_slots - 1).bit_length())
        out = []
        for bucket in self.prefill_buckets:
            count = 2
            while count <= widest and count * bucket <= self.max_prefill_length:
                out.append((count, bucket))
                count *= 2
        return tuple(out)

    def batchable(self, length: int) -> bool:
        """Whether a prefill of `length` tokens can share a batched program with others."""
        return length <= self.max_prefill_length and (2, self.prefill_bucket(length)) in self.prefill_batches

    def prefill_bucket(self, length: int) -> int:
        """The bucket a prefill of `length` tokens (<= max_prefill_length) is padded to."""
        return next(b for b in self.prefill_buckets if b >= length)

    def rows_bucket(self, rows: int) -> int:
        """Rows of a prefix holding `rows` valid rows: a power of two, capped at the cache length."""
        size = self.min_prefill_bucket
        while size < rows:
            size *= 2
        return min(size, self.cache_length)


def size_pool(config: EngineConfig, left_bytes: int, page_bytes: int) -> EngineConfig:
    """`config` (paged, `num_pages` 0) with a pool of `kv_memory_fraction` of the `left_bytes` per chip
    left after the weights, in pages of `page_bytes` per chip, capped at every slot full;
    KVPoolTooSmall when that is less than one request at cache_length."""
    full = config.num_slots * config.pages_per_slot + 1
    pages = int(left_bytes * config.kv_memory_fraction) // page_bytes + 1
    if pages - 1 < config.pages_per_slot:
        raise KVPoolTooSmall(
            f"engine.kv_memory_fraction={config.kv_memory_fraction} of the {left_bytes / 2**30:.2f} GiB per chip left "
            f"after the weights holds {pages - 1} KV pages of page_size={config.page_size}; one request at "
            f"cache_length={config.cache_length} needs {config.pages_per_slot} (more chips per rollout slice, "
            "a larger fraction, or a shorter cache_length)"
        )
    return dataclasses.replace(config, num_pages=min(pages, full))


def check_sampling(params: SamplingParams, *, filters: bool = True) -> str | None:
    """An error naming the bad field, or None. `filters`: whether the engine was built with top-k /
    top-p filtering (EngineConfig.sampling_filters)."""
    if not params.temperature >= 0:
        return f"sampling.temperature={params.temperature}; expected >= 0 (0 = greedy)"
    if not 0 < params.top_p <= 1:
        return f"sampling.top_p={params.top_p}; expected 0 < top_p <= 1"
    if params.top_k < 0:
        return f"sampling.top_k={params.top_k}; expected >= 0 (0 = off)"
    if not filters and params.temperature > 0 and (params.top_k > 0 or params.top_p < 1):
        return (
            f"sampling.top_k={params.top_k}, sampling.top_p={params.top_p}: this engine was built without "
            "top-k/top-p filtering (EngineConfig.sampling_filters=False, as a run whose rollout.top_k is 0 and "
            "rollout.top_p is 1 builds it); expected top_k=0 and top_p=1"
        )
    return None
