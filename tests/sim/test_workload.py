"""Response-length model: long tail calibrated per batch, deterministic across modes."""

import numpy as np

from dora_jax.sim.workload import CyclicLengths, LengthStream, WorkloadSpec, draw_lengths, mean_response


def test_batch_max_is_about_max_over_median_times_the_median():
    spec = WorkloadSpec()
    rng = np.random.default_rng(1)
    ratios = []
    for _ in range(20):
        batch = draw_lengths(spec, rng, spec.prompts_per_step)
        ratios.append(batch.max() / np.median(batch))
    assert 8.0 < np.median(ratios) < 18.0
    assert abs(np.median(batch) / spec.median_response - 1.0) < 0.1


def test_lengths_are_clipped_and_integral():
    spec = WorkloadSpec(median_response=100.0, max_response=300, max_over_median=50.0)
    batch = draw_lengths(spec, np.random.default_rng(0), 1000)
    assert batch.dtype == np.int64 and batch.min() >= 1 and batch.max() == 300


def test_stream_is_deterministic_per_seed():
    a, b = LengthStream(WorkloadSpec(seed=3)), LengthStream(WorkloadSpec(seed=3))
    assert [a.next_prompt() for _ in range(300)] == [b.next_prompt() for _ in range(300)]
    other = LengthStream(WorkloadSpec(seed=4)).next_prompt()
    assert other != LengthStream(WorkloadSpec(seed=3)).next_prompt()


def test_prompt_correlation_shares_variance_within_a_group():
    corr = WorkloadSpec(prompt_correlation=0.9)
    iid = WorkloadSpec(prompt_correlation=0.0)
    spread = lambda s: np.log(draw_lengths(s, np.random.default_rng(0), 2000)).std(axis=1).mean()
    assert spread(corr) < 0.5 * spread(iid)


def test_mean_response_exceeds_median_and_cyclic_lengths_repeat():
    assert mean_response(WorkloadSpec()) > WorkloadSpec().median_response
    cyc = CyclicLengths([[1, 2], [3, 4]])
    assert [cyc.next_prompt() for _ in range(3)] == [[1, 2], [3, 4], [1, 2]]
