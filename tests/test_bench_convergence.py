"""`bench convergence` judges the modes on held-out evaluation, by version and by publish time."""

from types import SimpleNamespace

import pytest

from dora_jax.bench import convergence


def _result(greedy, wall_per_step):
    steps = 4
    # As RunResult.metrics holds them: one row per step from step 0, without a "step" key.
    metrics = [{"wall_s": wall_per_step * (s + 1), "reward_mean": 0.1 * s} for s in range(steps)]
    evals = [{"step": v, "eval/reward_greedy": g, "eval/pass@4": min(1.0, g + 0.2)} for v, g in zip((4, 0, 2), greedy)]
    audit = SimpleNamespace(ok=True, max_staleness=1)
    return SimpleNamespace(metrics=metrics, evals=evals, wall_s=wall_per_step * steps + 1, audit=audit)


def test_curves_are_by_version_with_the_publish_time_and_compared_with_sync(tmp_path):
    sync = convergence.curve(_result((0.6, 0.2, 0.4), wall_per_step=10.0), samples=4)
    assert sync["eval_step"] == [0, 2, 4]  # sorted by version, whatever order the rounds finished in
    assert sync["eval_wall_s"] == [0.0, 20.0, 40.0]  # version v was published when step v - 1 ended
    assert sync["eval_greedy"] == [0.2, 0.4, 0.6] and sync["eval_pass"] == pytest.approx([0.4, 0.6, 0.8])
    dora = convergence.curve(_result((0.62, 0.2, 0.6), wall_per_step=5.0), samples=4)
    summary = convergence.summarize(dora, sync)
    assert summary["eval_greedy_final_minus_sync"] == pytest.approx(0.02)
    assert summary["wall_s_to_sync_final_eval"] == 10.0  # reached 0.6 at version 2, published at 10 s
    assert convergence.summarize(sync, sync)["wall_s_to_sync_final_eval"] == 40.0
    convergence.plot({"sync": sync, "dora_k1": dora}, str(tmp_path / "c.png"), samples=4)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
