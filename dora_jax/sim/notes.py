"""Plain-language notes for results.json: what matches the paper, what differs, and why.

Every number in a note is read from the results, so the notes stay true when the config changes;
the explanations are the model's known simplifications.
"""

from __future__ import annotations

_PAPER_IMPLIED_TOKENS_PER_SAMPLE = 14143 * 22.91 * 60 / 8192  # sync @ 64 GPUs: tokens/s x step / samples


def _winner_order(modes: dict, key: str = "step_time_s") -> list[str]:
    return sorted(modes, key=lambda m: modes[m][key])


def _within(ours, paper, factor: float = 1.5) -> str:
    if paper in (None, 0):
        return "n/a"
    if ours is None:
        return "unbounded: dora's trainer never waited"
    r = ours / paper
    return f"{r:.2f}x of paper, {'within' if 1 / factor <= r <= factor else 'OUTSIDE'} {factor}x"


def _setting_notes(n: str, setting: dict, paper: dict) -> list[str]:
    modes, ratios = setting["modes"], setting["ratios"]
    notes = []
    order = " < ".join(_winner_order(modes))
    paper_steps = {
        m: v["paper"]
        for k, v in paper.items()
        if k.startswith("step_time_min.")
        for m in [k.split(".", 1)[1]]
        if v["paper"] is not None
    }
    paper_order = " < ".join(sorted(paper_steps, key=paper_steps.get))
    notes.append(f"{n} GPUs: step time order (fastest first) ours {order}; paper {paper_order}.")
    for key in ("dora_vs_sync", "rollout_speedup_vs_sync"):
        if key in paper:
            notes.append(
                f"{n} GPUs: {key} ours {paper[key]['ours']} vs paper {paper[key]['paper']} "
                f"({_within(paper[key]['ours'], paper[key]['paper'])})."
            )
    best = ratios.get("dora_vs_best_other_async")
    notes.append(
        f"{n} GPUs: dora vs best other async ours {best} (paper 1.11-1.47; at this size the "
        f"paper's tables give {_paper_best(paper)})."
    )
    d = modes.get("dora", {})
    if d:
        notes.append(
            f"{n} GPUs: dora rollout-only share {d['rollout_only_share']:.3f} (paper "
            f"{paper.get('rollout_only_share.dora', {}).get('paper')}): its trainer waits "
            f"{d['trainer_wait_s']:.0f} s per step, bubble ratio {d['bubble_ratio']:.3f}, "
            f"KV migration {100 * d['migration_share']:.1f}% of rollout group-time "
            f"(paper: request transfer 2-3.6% of step time), audit_ok={d['audit_ok']}."
        )
    ablation = setting.get("kv_reuse_ablation")
    if ablation:
        notes.append(
            f"{n} GPUs: moving KV caches instead of re-prefilling migrated requests saves "
            f"{100 * ablation['rollout_time_saving']:.1f}% of rollout group-time "
            f"({ablation['prefill_tokens_saved']:,} prefill tokens; step "
            f"{ablation['step_time_s_with_re_prefill']:.0f} s -> "
            f"{ablation['step_time_s_with_kv_migration']:.0f} s). Paper: ~9% of rollout "
            f"time; the model migrates less (migration share above) and prefills at "
            f"~33K tokens/s per group."
        )
    p = modes.get("partial_rollout")
    if p:
        notes.append(
            f"{n} GPUs: partial_rollout audit_ok={p['audit_ok']}: the mode does not promise C1, "
            f"and {p['audit']['c1_violations']} trajectories mix versions "
            f"({p['interrupts']} interrupts); staleness from the dispatch version is at most "
            f"{p['max_staleness']} (K = {p['staleness_bound']}). Its re-prefill costs "
            f"{100 * p['prefill_share']:.1f}% of rollout slice-time; mixing versions costs "
            f"nothing in the model, so colocated partial rollout (all GPUs for both phases) "
            f"is dora's closest rival."
        )
    return notes


def _sweep_notes(scaling: dict) -> list[str]:
    rows = scaling.get("accelerators", {})
    lost = [
        f"{n} ({min(r['modes'], key=lambda m: r['modes'][m]['step_time_s'])} faster)"
        for n, r in rows.items()
        if min(r["modes"], key=lambda m: r["modes"][m]["step_time_s"]) != "dora"
    ]
    if not rows:
        return []
    first, last = next(iter(rows.values())), list(rows.values())[-1]
    return [
        f"Scaling sweep: dora_vs_sync goes {first['ratios'].get('dora_vs_sync')} -> "
        f"{last['ratios'].get('dora_vs_sync')} from {next(iter(rows))} to {list(rows)[-1]} "
        f"accelerators; dora is the fastest mode everywhere" + (f" except at {', '.join(lost)}." if lost else ".")
    ]


def _paper_best(paper: dict) -> str:
    dora = paper.get("step_time_min.dora", {}).get("paper")
    others = [paper.get(f"step_time_min.{m}", {}).get("paper") for m in ("one_step_off", "partial_rollout")]
    others = [o for o in others if o]
    return f"{min(others) / dora:.2f} by step time" if dora and others else "n/a"


def make_notes(results: dict) -> list[str]:
    notes = [
        "Policy: every mode is the shipped coordinator (its mode table, supply rule, version window, "
        "orchestrator and ledger) driving simulated rollout slices and a simulated trainer on a "
        "virtual clock; every ledger is checked by the project's auditor. The simulator models time "
        "and cost only (decode, prefill, weight loads, KV transfers, training, the workload).",
        "Calibration: only the paper's synchronous rows are targets (trainer fixed + per-token cost "
        "from sync's train time at 64 and 128 GPUs; decode t0 from sync's rollout time at 64 GPUs; "
        "decode t1 from HBM bandwidth and FLOPs). Sync at 128 GPUs and every asynchronous number "
        "are predictions.",
        "Placement: sync and partial_rollout colocated (every GPU rolls out, then every GPU trains), "
        "one_step_off and dora on a half/half trainer/rollout split, which is what the paper's DORA "
        "rows imply (trainer busy 12.9 / 7.95 min per step at 64 / 128 GPUs = T(32) / T(64)).",
    ]
    for n, setting in results["settings"].items():
        notes += _setting_notes(n, setting, results["paper"].get(f"gpus_{n}", {}))
    mean = results["workload"]["mean_response"]
    sync_rollout = " -> ".join(
        f"{s['modes']['sync']['rollout_only_s_per_step']:.0f} s"
        for s in results["settings"].values()
        if "sync" in s["modes"]
    )
    sync_bubbles = ", ".join(
        f"{s['modes']['sync']['bubble_ratio']:.2f} at {n}"
        for n, s in results["settings"].items()
        if "sync" in s["modes"]
    )
    notes += [
        f"Absolute tokens/s run ~{mean / _PAPER_IMPLIED_TOKENS_PER_SAMPLE:.2f}x the paper's in every "
        f"mode: the log-normal with median 2.4K has mean {mean:.0f} response tokens, while the "
        f"paper's sync row implies {_PAPER_IMPLIED_TOKENS_PER_SAMPLE:.0f} tokens per sample. "
        "Step times and ratios are what the calibration matches.",
        "rollout_speedup_vs_sync divides sync's rollout-only seconds by dora's, and dora's are a "
        "small residual: max(0, rollout work - train work) plus the waits for an old version's "
        "tail. It is ill-conditioned near balance and unbounded (None) when dora's trainer never "
        "waits, which is what the model predicts wherever dora's rollout half has more "
        "full-occupancy capacity than its trainer half needs. The paper's DORA trainer idled "
        "106 s / 151 s per step at 64 / 128 GPUs, i.e. its rollout delivered less per group at 128 "
        "GPUs (~2.1K tokens/s per 4 GPUs) than at 64 (~2.9K): the model has no mechanism for that "
        "drop (candidates: KV-cache pressure and preemption at long contexts, modelled as a fixed "
        "slot count; trainer-side weight sync; engine overheads).",
        f"Sync at 128 GPUs: the model's sync rollout shortens from 64 to 128 GPUs ({sync_rollout}; "
        "twice the slots, so fewer samples, long ones included, queue behind others), the paper's "
        "hardly did (893 -> 886 s).",
        f"bubble_ratio is time-weighted (idle slot-seconds); sync's is {sync_bubbles} GPUs "
        "(paper: 74-88% of rollout capacity idle); dora's residual bubble is the orphan tail of an old "
        "version on the slices that keep serving it, and, when trainer-bound, rollout capacity the "
        "version window does not let the coordinator fill.",
        "one_step_off vs sync at 64 GPUs: the paper's is a tie (22.94 vs 22.91 min); overlapping "
        "the stages hides the train time but each rollout phase still waits for its longest "
        "sample on half the GPUs, which is what the model shows too.",
        "Scaling sweep: with the batch fixed at 512 x 16, more GPUs cannot all be kept busy, so "
        "every mode's bubble ratio rises; sync is bounded by its longest sample, dora by the trainer "
        "and by the K window over the longest samples, so dora's advantage grows with size "
        "(paper, production at 4,096+ accelerators: 2-4x end to end).",
    ]
    return notes + _sweep_notes(results.get("scaling", {}))
