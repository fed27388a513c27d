"""Dynamic sampling end to end (docs/dynamic_sampling.md): the run config hands it to the
coordinator, the step rows carry its metrics, and a smoke-size embedded run on a task where most
groups saturate trains only batches of TBS samples of groups with reward variance."""

import json

import pytest

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.dynamic_sampling import why_uninformative
from dora_jax.coordinator.ledger import read_ledger
from dora_jax.runtime import run_config, runner, training_loop
from tests.helpers import tiny_config


def test_the_coordinator_gets_dynamic_sampling_from_the_trainer_config():
    config = run_config.parse(tiny_config("dora"))
    assert not config.coordinator.dynamic_sampling and not config.trainer.dynamic_sampling
    assert config.coordinator.max_filtered_batches_per_step == 10
    c = tiny_config("sync")
    with c.unlocked():
        c.trainer.dynamic_sampling = True
        c.coordinator.max_filtered_batches_per_step = 0
    config = run_config.parse(c)
    assert config.coordinator.dynamic_sampling and config.trainer.dynamic_sampling
    assert config.coordinator.max_filtered_batches_per_step == 0
    with c.unlocked():
        c.coordinator.max_filtered_batches_per_step = -2
    with pytest.raises(ValueError, match="coordinator.max_filtered_batches_per_step=-2; expected >= 0"):
        run_config.parse(c)


def test_the_step_row_reports_the_filtered_fraction_and_the_extra_samples():
    last = {"scored_groups": 10, "filtered_groups": 4, "filtered_samples": 16}
    stats = {"scored_groups": 18, "filtered_groups": 10, "filtered_samples": 40}
    # 8 groups completed since the last take, 6 filtered (24 samples) for a batch of 8 samples.
    assert training_loop.dynamic_sampling_row(stats, last, 8) == {
        "dynamic_sampling/filtered_groups": 6,
        "dynamic_sampling/filtered_fraction": 0.75,
        "dynamic_sampling/extra_samples_per_trained": 3.0,
    }
    nothing = training_loop.dynamic_sampling_row({}, {}, 8)  # a source without these counters
    assert nothing["dynamic_sampling/filtered_fraction"] == 0.0
    assert nothing["dynamic_sampling/extra_samples_per_trained"] == 0.0


def saturating_config(mode: str, steps: int):
    """The smoke config shrunk (tests/helpers.py), on a running-sums mix where most groups saturate:
    prompts of 1 to 3 terms, a third of them of one term (the first 30 of seed 0: 10), and a brief
    SFT (40 updates) that leaves the tiny model right about a third of the time on one-term prompts
    (0.35 measured) and never on longer ones, so groups of longer prompts are all wrong."""
    c = tiny_config(mode, steps=steps)
    with c.unlocked():
        c.init.sft_steps = 40
        c.init.sft_lr = 1e-2
        c.task.median_k = 2.0
        c.task.k_max = 3
        c.task.max_term = 1
        c.rollout.cache_length = 64
        c.rollout.max_prefill_length = 32
        c.rollout.max_new_tokens = 16
        c.trainer.dynamic_sampling = True
        c.coordinator.max_filtered_batches_per_step = 0  # no limit: the limit has its own tests (tests/coordinator)
        c.log.tensorboard = False
    return c


@pytest.mark.slow
def test_a_run_where_most_groups_saturate_trains_only_informative_batches(tmp_path):
    steps, tbs = 3, 8
    result = runner.run(run_config.parse(saturating_config("dora", steps)), str(tmp_path), progress=False)
    assert result.steps == steps
    events = list(read_ledger(str(tmp_path / "ledger.jsonl")))
    report = audit(events)
    assert report.ok, report.summary()
    assert report.consumed == steps * tbs and report.dynamic_sampling
    assert report.filtered_groups * 2 > report.scored_groups  # most completed groups were filtered
    assert report.filtered == 4 * report.filtered_groups and report.stranded == 0
    # Every trained batch: TBS samples, each of a group whose recorded rewards vary.
    scores = {e["group"]: e for e in events if e["ev"] == "score"}
    for step in range(steps):
        consumed = [e for e in events if e["ev"] == "consume" and e["trainer_version"] == step]
        assert len(consumed) == tbs
        for group in {e["group"] for e in consumed}:
            assert why_uninformative(scores[group]["rewards"], scores[group]["valid"]) is None
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["dropped_groups"] == 0 for r in rows)  # the trainer's own mask found nothing left to drop
    filtered = sum(r["dynamic_sampling/filtered_groups"] for r in rows)
    assert 0 < filtered <= report.filtered_groups
    assert all(0.0 <= r["dynamic_sampling/filtered_fraction"] <= 1.0 for r in rows)
    assert any(r["dynamic_sampling/extra_samples_per_trained"] > 0 for r in rows)
