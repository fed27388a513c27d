"""`bench modes` bookkeeping: forced lengths, busy-time unions, the window profile at each take,
ratios and the bound (the runs themselves are what `python -m dora_jax.bench modes` measures)."""

import json

import numpy as np
import pytest

from dora_jax.bench.disaggregated import read_run
from dora_jax.bench.mode_row import busy_union, mode_row, overlap, straggler_latency, take_profile
from dora_jax.bench.modes import bound, median_of_rounds, ratios
from dora_jax.coordinator.trace import LengthDistribution
from dora_jax.rollout import timeline
from dora_jax.rollout.timeline import BusyTimeline
from dora_jax.rollout.worker import WorkerCounters


def test_forced_lengths_are_keyed_by_prompt_and_sample_and_follow_the_log_normal():
    lengths = LengthDistribution(median=20.0, sigma=1.1, max_len=320)
    draws = np.array([lengths.draw(f"p{i}", s, seed=0) for i in range(2000) for s in range(4)])
    again = np.array([lengths.draw(f"p{i}", s, seed=0) for i in range(2000) for s in range(4)])
    assert (draws == again).all()  # every mode decodes the same work
    reseeded = np.array([lengths.draw(f"p{i}", s, seed=1) for i in range(2000) for s in range(4)])
    assert (reseeded != draws).mean() > 0.8  # the seed, prompt and sample key each draw
    assert draws.min() >= 1 and draws.max() <= 320 and (draws == 320).any()  # capped, and the cap is reached
    assert abs(np.median(draws) - 20) <= 2
    assert 0.08 < (draws > 60).mean() < 0.20  # P(log-normal > 3x median) = P(z > ln3 / 1.1) = 0.16


def test_busy_union_merges_overlaps_and_overlap_sums_shared_time():
    rollout = busy_union([(0.0, 1.0, 0, 1.0), (0.5, 2.0, 1, 0.5), (3.0, 4.0, 1, 1.0)])
    assert rollout == [(0.0, 2.0), (3.0, 4.0)]
    assert overlap(rollout, [(1.5, 3.5)]) == pytest.approx(1.0)


def test_take_profile_counts_what_the_window_holds_when_the_trainer_takes():
    events = [{"ev": "dispatch", "traj": f"g{g}/{i}", "group": f"g{g}"} for g in range(3) for i in range(2)]
    events += [{"ev": "finish", "traj": t} for t in ("g0/0", "g0/1", "g1/0")]  # g1/1 and both of g2 decode
    events += [{"ev": "consume", "traj": t, "step": 0} for t in ("g0/0", "g0/1")]
    events += [{"ev": "finish", "traj": t} for t in ("g1/1", "g2/0", "g2/1")]
    events += [{"ev": "consume", "traj": t, "step": 1} for t in ("g1/0", "g1/1")]
    profile = take_profile(events)
    # step 0: 3 decoding, g1/0 waits on its sibling, g0 complete; step 1: nothing decoding, g1 and g2 complete
    assert profile == {"decoding": 1.5, "finished_in_incomplete_groups": 0.5, "finished_in_complete_groups": 3.0}
    assert take_profile([]) == {}


def test_ratios_and_the_bound_time_each_role_alone():
    modes = {
        "sync": {"tokens_per_s": 100.0, "rollout_only_s_per_step": 2.0, "train_tokens": 400, "train_busy_s": 0.5},
        "one_step_off": {"tokens_per_s": 150.0, "rollout_only_s_per_step": 1.0},
        "dora": {
            "tokens_per_s": 250.0,
            "rollout_only_s_per_step": 0.5,
            "generated_tokens": 1000,
            "train_tokens": 500,
            "train_busy_s": 1.0,
        },
    }
    out = ratios(modes)
    assert out["dora_vs_sync"] == 2.5 and out["dora_vs_one_step_off"] == pytest.approx(5 / 3)
    assert out["dora_vs_partial_rollout"] is None and out["rollout_speedup_vs_sync"] == 4.0
    # 1 s of decode at the full-occupancy rate + dora's 500 train tokens at sync's 800 tokens/s, summed;
    # dora's own (contended) 1 s of training does not enter
    b = bound(modes, slot_rate=1000.0)
    assert b["rollout_s"] == 1.0 and b["train_s"] == 0.625 and b["tokens_per_s"] == pytest.approx(500 / 1.625)
    assert "sync's train rate" in b["how"]
    # without a sync run, dora's own train-busy time is what is left
    del modes["sync"]
    b = bound(modes, slot_rate=1000.0)
    assert b["train_s"] == 1.0 and b["tokens_per_s"] == 250.0 and "generous" in b["how"]


def test_straggler_latency_is_each_batchs_slowest_sample_from_first_dispatch_to_finish():
    events = [{"ev": "dispatch", "traj": t, "t": 0.0} for t in ("a", "b", "c")]
    events += [{"ev": "finish", "traj": "a", "t": 1.0}, {"ev": "finish", "traj": "b", "t": 4.0}]
    events += [{"ev": "consume", "traj": t, "step": 0} for t in ("a", "b")]  # batch 0: b took 4 s
    events += [{"ev": "dispatch", "traj": "c", "t": 2.0}]  # a re-dispatch does not restart the clock
    events += [
        {"ev": "dispatch", "traj": "d", "t": 5.0},
        {"ev": "finish", "traj": "d", "t": 5.5},
        {"ev": "finish", "traj": "c", "t": 6.0},
    ]
    events += [{"ev": "consume", "traj": t, "step": 1} for t in ("c", "d")]  # batch 1: c took 6 s
    assert straggler_latency(events) == 5.0
    assert straggler_latency([]) == 0.0


def test_rounds_combine_by_median_with_every_audit_and_the_worst_staleness():
    rows = [
        {
            "tokens_per_s": 100.0,
            "steps": 24,
            "audit_ok": True,
            "max_staleness": 2,
            "how": "x",
            "ratio": None,
            "at_take": {"decoding": 1.0},
        },
        {
            "tokens_per_s": 300.0,
            "steps": 24,
            "audit_ok": False,
            "max_staleness": 3,
            "how": "x",
            "ratio": 1.0,
            "at_take": {"decoding": 3.0},
        },
        {
            "tokens_per_s": 120.0,
            "steps": 24,
            "audit_ok": True,
            "max_staleness": 1,
            "how": "x",
            "ratio": 2.0,
            "at_take": {"decoding": 2.0},
        },
    ]
    assert median_of_rounds(rows) == {
        "tokens_per_s": 120.0,
        "steps": 24,
        "audit_ok": False,
        "max_staleness": 3,
        "how": "x",
        "ratio": None,
        "at_take": {"decoding": 2.0},
    }
    assert median_of_rounds(rows[:1]) == rows[0]


def test_on_disjoint_cores_the_bound_is_the_larger_role_with_doras_own_training():
    modes = {
        "sync": {"train_tokens": 400, "train_busy_s": 0.5},
        "dora": {"tokens_per_s": 250.0, "generated_tokens": 1500, "train_tokens": 500, "train_busy_s": 1.0},
    }
    b = bound(modes, slot_rate=1000.0, disjoint=True)
    # dora's 1 s of training (its recompute included) on the trainer's own core, not sync's rate
    assert b["rollout_s"] == 1.5 and b["train_s"] == 1.0 and b["tokens_per_s"] == pytest.approx(500 / 1.5)
    modes["dora"]["train_busy_s"] = 2.0
    assert bound(modes, slot_rate=1000.0, disjoint=True)["tokens_per_s"] == 250.0  # training binds
    assert "disjoint cores" in b["how"]


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_a_role_process_jobs_figures_are_read_from_its_workdir(tmp_path):
    """The ledger's first dispatch to the end of the last train step is the job's time; decoding
    after it is not counted; rollout-only time is decode time that no train step overlaps."""
    t = 1000.0
    events = [
        {"ev": "run", "mode": "dora", "k_max": 3, "rbs": 4, "tbs": 2, "group_size": 2, "slices": 1, "t": t},
        {"ev": "load_version", "slice": 0, "version": 0, "digest": "d0", "t": t},
    ]
    for traj, start, end in (("g0/0", 1.0, 2.0), ("g0/1", 1.0, 4.0)):
        events.append(
            {"ev": "dispatch", "traj": traj, "group": "g0", "prompt": "p0", "version": 0, "slice": 0, "t": t + start}
        )
        events.append(
            {"ev": "finish", "traj": traj, "version": 0, "versions_seen": [0], "tokens": 3, "reason": "forced"}
            | {"slice": 0, "t": t + end}
        )
    events += [
        {"ev": "consume", "traj": traj, "group": "g0", "version": 0, "step": 0, "trainer_version": 0, "t": t + 4.0}
        for traj in ("g0/0", "g0/1")
    ]
    events += [
        {"ev": "behaviour", "step": 0, "digests": {"0": "d0"}, "t": t + 5.0},
        {"ev": "publish", "version": 1, "step": 1, "t": t + 5.0},
    ]
    _write_jsonl(tmp_path / "ledger.jsonl", events)
    rows = [
        {
            "step": 0,
            "loss_tokens": 6,
            "generated_tokens": 0,
            "trainer_wait_s": 3.0,
            "train_interval_t": [t + 4.0, t + 5.0],
        }
    ]
    _write_jsonl(tmp_path / "metrics.jsonl", rows)
    bars = BusyTimeline()
    bars.step(t + 1.0, t + 4.5, 0, 0.5)  # half the slots busy, 4.5 s; the last 0.5 s overlaps the train step
    bars.step(t + 5.5, t + 6.0, 1, 1.0)  # after the last step: not counted
    timeline.write(str(tmp_path), 0, bars, WorkerCounters())
    run = read_run(str(tmp_path), num_slots=4)
    inputs = run["inputs"]
    assert inputs["wall_s"] == pytest.approx(4.0)  # first dispatch (t+1) to the last step's end (t+5)
    assert inputs["slot_steps"] == 4 and inputs["idle_slot_steps"] == 2 and inputs["generated_tokens"] == 2
    assert inputs["train_busy_s"] == pytest.approx(1.0) and inputs["report"].ok
    row = mode_row(**inputs)
    assert row["rollout_only_share"] == pytest.approx(3.0 / 4.0)  # 3.5 s decoding, 0.5 s of it under training
    assert row["tokens_per_s"] == pytest.approx(6 / 4.0) and row["bubble_ratio"] == 0.5
    assert row["straggler_s"] == pytest.approx(3.0) and row["trainer_wait_s"] == 3.0
    assert run["timelines"]["slices"] == [[(t + 1.0, t + 4.5, 0, 0.5)]]
    assert run["timelines"]["trainer"] == [(t + 4.0, t + 5.0, 0)]
    # Work done while waiting for the batch (grad_ahead) is the trainer's work too.
    _write_jsonl(tmp_path / "metrics.jsonl", [{**rows[0], "grad_ahead_s": 0.25}])
    assert read_run(str(tmp_path), num_slots=4)["inputs"]["train_busy_s"] == pytest.approx(1.25)
    # The coordinator's waits on slice commands come from the stats file its process writes.
    assert row["coordinator_port_wait_s"] is None and row["coordinator_port_wait_by_call_s"] is None
    waits = {"submit": 0.25, "load_version": 1.5, "import_": 0.5}
    (tmp_path / "coordinator_stats.json").write_text(json.dumps({"dispatched": 2, "port_wait_s": waits}))
    row = mode_row(**read_run(str(tmp_path), num_slots=4)["inputs"])
    assert row["coordinator_port_wait_s"] == pytest.approx(2.25)
    assert row["coordinator_port_wait_by_call_s"] == {"import_": 0.5, "load_version": 1.5, "submit": 0.25}


def test_a_mode_variant_runs_its_mode_with_its_fields_and_is_compared_with_it():
    """`bench.modes` may name MODE+VARIANT: the mode with the variant's config fields (the flags a
    launch_local job gets), and its ratio against its own mode; a bad name says what was expected."""
    from dora_jax.bench.mode_row import split_mode, variant_flags

    assert split_mode("dora") == ("dora", {})
    assert split_mode("dora+score_ahead") == ("dora", {"trainer.score_ahead": True})
    assert split_mode("dora+score_ahead+rollout_scored") == (
        "dora",
        {"trainer.score_ahead": True, "trainer.behaviour_logps": "rollout"},
    )
    assert variant_flags("one_step_off+rollout_scored") == [
        "--config.mode=one_step_off",
        "--config.trainer.behaviour_logps=rollout",
    ]
    for bad in ("dora+faster", "fast+score_ahead", "dora+score_ahead+score_ahead", "dora+"):
        with pytest.raises(ValueError, match="optionally \\+VARIANT"):
            split_mode(bad)
    assert split_mode("partial_rollout+sampler_logps") == ("partial_rollout", {"trainer.behaviour_logps": "sampler"})
    with pytest.raises(ValueError, match="set trainer.behaviour_logps to both 'rollout' and 'sampler'"):
        split_mode("dora+rollout_scored+sampler_logps")
    rows = {"dora": {"tokens_per_s": 200.0, "rollout_only_s_per_step": 0.0}}
    rows["dora+score_ahead"] = {"tokens_per_s": 230.0, "rollout_only_s_per_step": 0.0}
    assert ratios(rows)["dora+score_ahead_vs_dora"] == pytest.approx(1.15)
