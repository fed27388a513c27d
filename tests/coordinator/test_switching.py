"""switching.LeastLoaded: the same slice as `least_loaded` at every step of a pass."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.coordinator.switching import LeastLoaded, least_loaded


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4)), min_size=1, max_size=8),
    st.lists(st.one_of(st.none(), st.integers(0, 7)), max_size=40),
)
def test_least_loaded_heap_picks_what_the_scan_picks(slices, steps):
    """Per step: a send to the picked slice (its load grows by one), or (an int) that slice
    starts failing; the heap's pick equals the scan over the slices not failing."""
    trajs = {s: [f"held{s}_{i}" for i in range(load)] for s, (load, _) in enumerate(slices)}
    slots = {s: n for s, (_, n) in enumerate(slices)}
    failing: set[int] = set()
    heap = LeastLoaded(list(trajs), trajs, slots, failing)
    for i, step in enumerate(steps):
        if step is not None:
            failing.add(step)
            continue
        live = [s for s in trajs if s not in failing]
        picked = heap.pick()
        assert picked == (least_loaded(live, trajs, slots) if live else None)
        if picked is not None:
            trajs[picked].append(f"sent{i}")
