"""Runs a scenario (paper settings + scaling sweep, or a projection of a real config) and
assembles results.json and a table."""

from __future__ import annotations

import dataclasses
import json
import os

from dora_jax.core.modes import Mode
from dora_jax.sim.notes import make_notes
from dora_jax.sim.projection import LABEL, Projection
from dora_jax.sim.projection import notes as projection_notes
from dora_jax.sim.runs import RunTask, run_tasks
from dora_jax.sim.scenario import Scenario
from dora_jax.sim.simulate import ModeResult
from dora_jax.sim.workload import WorkloadSpec, mean_response

_OTHER_ASYNC = (Mode.ONE_STEP_OFF, Mode.PARTIAL_ROLLOUT)

DEFINITIONS = dict(
    step_time_s="measured window (publish of step `warmup` to the last publish) / measured steps",
    tokens_per_s="response tokens trained in the window / window seconds",
    rollout_only_share="share of the window with some rollout request active and the trainer idle",
    bubble_ratio="idle slot-seconds / slot-seconds of the rollout slices (time-weighted; "
    "colocated slices are not counted while they train)",
    trainer_wait_s="trainer idle seconds per measured step",
    max_staleness="max over consumed samples of trainer version - the version the sample was dispatched with",
    audit_ok="the project's auditor (dora_jax.coordinator.audit, as `python -m dora_jax.audit` on the run's "
    "ledger) finds no violation of what the mode promises: C2 (nothing dropped or stranded), C3 "
    "(staleness <= bound, groups of one version), exactly once, weights, and C1 except for "
    "partial_rollout, which does not promise it",
    policy="every mode is the shipped coordinator (dora_jax.core.modes, dora_jax.coordinator) driving simulated "
    "slices and trainer; the simulator models time and cost only",
    rollout_speedup_vs_sync="sync rollout-only seconds per step / dora rollout-only seconds per step",
    bound="step work with every slot busy and nobody waiting: max(rollout work, train work) on the "
    "split DORA uses (rollout and trainer are distinct hardware)",
)


def setting_tasks(
    sc: Scenario,
    accelerators: int,
    workload: WorkloadSpec,
    steps: int,
    warmup: int,
    ledger_dir: str | None = None,
    ablation: bool = False,
) -> list[RunTask]:
    """The runs of one setting: every mode, then (with `ablation`) DORA with re-prefill instead
    of KV-cache migration."""
    tasks = [
        RunTask(
            mode,
            accelerators,
            workload,
            steps,
            warmup,
            ledger_path=(
                os.path.join(ledger_dir, f"{accelerators}gpus_{mode.value}.ledger.jsonl") if ledger_dir else None
            ),
        )
        for mode in sc.options.modes
    ]
    if ablation and Mode.DORA in sc.options.modes:
        tasks.append(RunTask(Mode.DORA, accelerators, workload, steps, warmup, kv_migration=False))
    return tasks


def run_setting(
    sc: Scenario,
    accelerators: int,
    workload: WorkloadSpec,
    steps: int,
    warmup: int,
    ledger_dir: str | None = None,
    ablation: bool = False,
    jobs: int = 1,
) -> dict:
    """Every mode of the scenario on `accelerators` GPUs; returns the setting's results block.

    With `ablation`, DORA also runs with re-prefill instead of KV-cache migration.
    """
    tasks = setting_tasks(sc, accelerators, workload, steps, warmup, ledger_dir, ablation)
    return setting_block(sc, accelerators, workload, tasks, run_tasks(sc, tasks, jobs))


def setting_block(
    sc: Scenario, accelerators: int, workload: WorkloadSpec, tasks: list[RunTask], runs: list[ModeResult]
) -> dict:
    """The results block of one setting from its tasks (`setting_tasks`) and their results."""
    results = {t.mode: r for t, r in zip(tasks, runs, strict=True) if t.kv_migration}
    placement = {}
    for mode in results:
        cluster = sc.placements.cluster(sc.costs, mode, accelerators, workload)
        placement[mode.value] = dict(
            placement=cluster.placement.value,
            rollout_groups=cluster.num_groups,
            rollout_accelerators=cluster.rollout_accelerators,
            train_accelerators=cluster.train_accelerators,
        )
    out = dict(
        accelerators=accelerators,
        placement=placement,
        modes={m.value: r.as_dict() for m, r in results.items()},
        bound=_bound(sc, accelerators, workload),
        ratios=_ratios(results),
    )
    plain = next((r for t, r in zip(tasks, runs, strict=True) if not t.kv_migration), None)
    if plain is not None:
        with_kv = results[Mode.DORA]
        out["kv_reuse_ablation"] = dict(
            step_time_s_with_kv_migration=round(with_kv.step_time_s, 2),
            step_time_s_with_re_prefill=round(plain.step_time_s, 2),
            # Rollout group-time that re-prefilling migrated requests would cost, net of the KV
            # transfers that replace it (both as shares of rollout group-time).
            rollout_time_saving=round(plain.prefill_share - with_kv.prefill_share - with_kv.migration_share, 4),
            prefill_tokens_saved=round(plain.prefill_tokens - with_kv.prefill_tokens),
        )
    return out


def _bound(sc: Scenario, accelerators: int, workload: WorkloadSpec) -> dict:
    n_train = sc.placements.split(sc.costs, accelerators, workload)
    rollout = sc.costs.rollout_work_s(accelerators - n_train, workload)
    train = sc.costs.train_work_s(n_train, workload)
    tokens = workload.batch_samples * mean_response(workload)
    return dict(
        tokens_per_s=round(tokens / max(rollout, train), 1),
        step_time_s=round(max(rollout, train), 2),
        how=(
            f"split {accelerators - n_train} rollout / {n_train} trainer accelerators; per step: rollout "
            f"work with every slot busy ({rollout:.0f} s = mean tokens x t(S)/S + prompt prefill, "
            f"over {(accelerators - n_train) // sc.costs.accelerators_per_group} groups) and train "
            f"work ({train:.0f} s) on distinct hardware -> max of the two, nobody waiting; the "
            f"work is a mean batch, so a mode whose measured batches hold more tokens (dora's "
            f"oldest-first consumption leaves long samples for later steps) can edge past it"
        ),
    )


def _ratios(results: dict[Mode, ModeResult]) -> dict:
    if Mode.DORA not in results:
        return {}
    dora = results[Mode.DORA]
    out = {
        f"dora_vs_{m.value}": round(dora.tokens_per_s / r.tokens_per_s, 3) for m, r in results.items() if m != Mode.DORA
    }
    others = [results[m].tokens_per_s for m in _OTHER_ASYNC if m in results]
    if others:
        out["dora_vs_best_other_async"] = round(dora.tokens_per_s / max(others), 3)
    if Mode.SYNC in results:
        sync_s, dora_s = results[Mode.SYNC].rollout_only_s_per_step, dora.rollout_only_s_per_step
        # None: unbounded, dora's trainer (practically) never waited for rollout.
        out["rollout_speedup_vs_sync"] = round(sync_s / dora_s, 2) if dora_s > 1e-3 * sync_s else None
    return out


def paper_comparison(sc: Scenario, settings: dict) -> dict:
    """The paper's table values next to ours, with ours / paper."""
    block = {}
    for n, setting in settings.items():
        paper = sc.paper.get(f"gpus_{n}")
        if paper is None:
            continue
        rows = {}
        for metric, scale in (("rollout_only_share", 1.0), ("step_time_min", 60.0), ("tokens_per_s", 1.0)):
            key = "step_time_s" if metric == "step_time_min" else metric
            for mode, ref in paper[metric].items():
                if mode not in setting["modes"]:
                    continue
                ours = setting["modes"][mode][key] / scale
                rows[f"{metric}.{mode}"] = _triple(ref, ours)
        for mode in ("sync", "dora"):
            share, step = paper["rollout_only_share"][mode], paper["step_time_min"][mode]
            ours = setting["modes"].get(mode, {}).get("rollout_only_s_per_step")
            rows[f"rollout_only_s_per_step.{mode}"] = _triple(share * step * 60.0, ours)
        ratios = setting["ratios"]
        rows["rollout_speedup_vs_sync"] = _triple(
            paper["rollout_speedup_vs_sync"], ratios.get("rollout_speedup_vs_sync")
        )
        rows["dora_vs_sync"] = _triple(paper["dora_vs_sync"], ratios.get("dora_vs_sync"))
        lo, hi = sc.paper["dora_vs_best_other_async"]
        rows["dora_vs_best_other_async"] = dict(paper=f"{lo}-{hi}", ours=ratios.get("dora_vs_best_other_async"))
        block[f"gpus_{n}"] = rows
    return block


def _triple(paper, ours) -> dict:
    ratio = None if paper in (None, 0) or ours is None else round(ours / paper, 3)
    return dict(paper=paper, ours=None if ours is None else round(ours, 4), ours_over_paper=ratio)


def sweep_workloads(sc: Scenario) -> dict[int, WorkloadSpec]:
    """The workload of each sweep size (the batch grows with the size when proportional)."""
    base = sc.sweep_accelerators[0]
    out = {}
    for n in sc.sweep_accelerators:
        workload = sc.workload
        if sc.sweep_batch_scaling == "proportional":
            workload = dataclasses.replace(workload, prompts_per_step=workload.prompts_per_step * n // base)
        out[n] = workload
    return out


def run_sweep(sc: Scenario, jobs: int = 1) -> dict:
    """Step time and bubble ratio per mode from the smallest to the largest sweep size."""
    workloads = sweep_workloads(sc)
    tasks = {n: setting_tasks(sc, n, w, sc.sweep_steps, sc.sweep_warmup) for n, w in workloads.items()}
    runs = _run_grouped(sc, tasks, jobs)
    return sweep_block(sc, {n: setting_block(sc, n, workloads[n], tasks[n], runs[n]) for n in tasks})


def _run_grouped(sc: Scenario, tasks: dict, jobs: int) -> dict:
    """`run_tasks` over every group's tasks at once (one pool for all); results by group."""
    flat = [task for group in tasks.values() for task in group]
    results = iter(run_tasks(sc, flat, jobs))
    return {key: [next(results) for _ in group] for key, group in tasks.items()}


_SWEEP_KEYS = (
    "step_time_s",
    "bubble_ratio",
    "tokens_per_s",
    "rollout_only_share",
    "trainer_wait_s",
    "max_staleness",
    "audit_ok",
    "coordinator_s_per_step",
    "orchestration_overhead",
    "rebalance_ms_p99",
)


def sweep_block(sc: Scenario, settings: dict[int, dict]) -> dict:
    """results.json's `scaling` block from each sweep size's setting block."""
    rows = {}
    for n, setting in settings.items():
        rows[str(n)] = dict(
            prompts_per_step=sweep_workloads(sc)[n].prompts_per_step,
            train_accelerators_split=setting["placement"].get(Mode.DORA.value, {}).get("train_accelerators"),
            modes={m: {k: v[k] for k in _SWEEP_KEYS} for m, v in setting["modes"].items()},
            ratios=setting["ratios"],
            bound_tokens_per_s=setting["bound"]["tokens_per_s"],
        )
    return dict(batch_scaling=sc.sweep_batch_scaling, accelerators=rows)


def format_table(results: dict) -> str:
    """A plain-text table: per setting, one row per metric, paper value in brackets."""
    lines = [results["label"]] if "label" in results else []
    unit = results.get("unit", "GPUs")
    for key, setting in results["settings"].items():
        modes = list(setting["modes"])
        paper = results["paper"].get(f"gpus_{key}", {})
        lines.append(
            f"\n== {key} {unit} ==  "
            + "  ".join(
                f"{m}: {p['rollout_accelerators']}R/{p['train_accelerators']}T {p['placement']}"
                for m, p in setting["placement"].items()
            )
        )
        lines.append(f"{'metric':<22}" + "".join(f"{m:>22}" for m in modes))
        for metric, key2, fmt, scale in (
            ("step_time_min", "step_time_s", "{:.2f}", 60.0),
            ("tokens_per_s", "tokens_per_s", "{:.0f}", 1.0),
            ("rollout_only_share", "rollout_only_share", "{:.2f}", 1.0),
            ("bubble_ratio", "bubble_ratio", "{:.2f}", 1.0),
            ("trainer_wait_s", "trainer_wait_s", "{:.0f}", 1.0),
            ("max_staleness", "max_staleness", "{}", 1.0),
            ("audit_ok", "audit_ok", "{}", 1.0),
            ("coordinator_s/step", "coordinator_s_per_step", "{:.2f}", 1.0),
            ("orchestration_share", "orchestration_overhead", "{:.4f}", 1.0),
            ("rebalance_ms_p99", "rebalance_ms_p99", "{:.1f}", 1.0),
        ):
            cells = []
            for m in modes:
                value = setting["modes"][m][key2]
                cell = fmt.format(value / scale if scale != 1.0 else value)
                ref = paper.get(f"{metric}.{m}", {}).get("paper")
                cells.append(cell + (f" [{ref}]" if ref is not None else ""))
            lines.append(f"{metric:<22}" + "".join(f"{c:>22}" for c in cells))
        ratios = "  ".join(
            f"{k}={v}" + (f" [{paper[k]['paper']}]" if k in paper else "") for k, v in setting["ratios"].items()
        )
        lines.append(f"ratios: {ratios}")
        lines.append(f"bound: {setting['bound']['tokens_per_s']:.0f} tokens/s")
    sweep = results.get("scaling", {}).get("accelerators", {})
    if sweep:
        modes = list(next(iter(sweep.values()))["modes"])
        lines.append(f"\n== scaling ({results['scaling']['batch_scaling']} batch): step time s / bubble ==")
        overhead = "dora orchestration share / rebalance p99 ms"
        lines.append(f"{'GPUs':>6}" + "".join(f"{m:>22}" for m in modes) + f"{'dora_vs_sync':>14}  {overhead}")
        for n, row in sweep.items():
            cells = "".join(
                f"{row['modes'][m]['step_time_s']:>13.0f} / {row['modes'][m]['bubble_ratio']:.2f}" for m in modes
            )
            dora = row["modes"].get(Mode.DORA.value, {})
            cost = f"{dora.get('orchestration_overhead', 0):.4f} / {dora.get('rebalance_ms_p99', 0):.1f}"
            lines.append(f"{n:>6}{cells}{row['ratios'].get('dora_vs_sync', ''):>14}  {cost:>{len(overhead)}}")
    return "\n".join(lines)


def run_all(sc: Scenario, out_dir: str, ledger: bool = False, sweep: bool = True, jobs: int = 1) -> dict:
    """Paper settings, comparison, sweep and notes; writes out_dir/results.json and returns it.
    The settings' and the sweep's runs share one pool of `jobs` processes."""
    os.makedirs(out_dir, exist_ok=True)
    tasks = _settings_tasks(sc, out_dir if ledger else None)
    workloads = sweep_workloads(sc) if sweep else {}
    for n, workload in workloads.items():
        tasks["sweep", n] = setting_tasks(sc, n, workload, sc.sweep_steps, sc.sweep_warmup)
    runs = _run_grouped(sc, tasks, jobs)
    settings = {
        str(n): setting_block(sc, n, sc.workload, tasks[kind, n], runs[kind, n])
        for kind, n in tasks
        if kind == "setting"
    }
    scaling = {n: setting_block(sc, n, w, tasks["sweep", n], runs["sweep", n]) for n, w in workloads.items()}
    results = dict(
        settings=settings,
        paper=paper_comparison(sc, {int(k): v for k, v in settings.items()}),
        scaling=sweep_block(sc, scaling) if sweep else {},
        **_inputs(sc),
    )
    results["notes"] = make_notes(results)
    return _write(results, out_dir)


def run_projection(projection: Projection, out_dir: str, ledger: bool = False, jobs: int = 1) -> dict:
    """A real config's pod projected from XLA's estimates (dora_jax.sim.projection): every mode,
    no paper comparison, no sweep; results.json says, at its top, that the numbers are estimated."""
    sc = projection.scenario
    results = dict(
        kind="projection",
        label=LABEL,
        unit=f"chips ({projection.estimates.trainer_type} + {projection.estimates.rollout_type}), estimated",
        projection=projection.as_dict(),
        settings=_run_settings(sc, out_dir, ledger, jobs),
        paper={},
        scaling={},
        **_inputs(sc),
    )
    results["notes"] = projection_notes(projection, results)
    return _write(results, out_dir)


def _settings_tasks(sc: Scenario, ledger_dir: str | None) -> dict:
    """The paper settings' runs (every mode and the re-prefill ablation), keyed ("setting", n)."""
    return {
        ("setting", n): setting_tasks(
            sc, n, sc.workload, sc.options.steps, sc.options.warmup, ledger_dir=ledger_dir, ablation=True
        )
        for n in sc.settings
    }


def _run_settings(sc: Scenario, out_dir: str, ledger: bool, jobs: int) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    tasks = _settings_tasks(sc, out_dir if ledger else None)
    runs = _run_grouped(sc, tasks, jobs)
    return {str(n): setting_block(sc, n, sc.workload, tasks[kind, n], runs[kind, n]) for kind, n in tasks}


def _inputs(sc: Scenario) -> dict:
    return dict(
        workload=dataclasses.asdict(sc.workload)
        | dict(sigma=round(sc.workload.sigma, 4), mean_response=round(mean_response(sc.workload), 1)),
        costs=dataclasses.asdict(sc.costs),
        definitions=DEFINITIONS,
    )


def _write(results: dict, out_dir: str) -> dict:
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results
