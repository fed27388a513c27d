"""`python -m dora_jax.tpu_compile --config=configs/qwen2_5_7b_dapo.py --out=DIR [--target=pod|local|v5e:2x4]`

Compiles every program of each role ahead of time for the config's TPU topologies, on this
machine, without a TPU (dora_jax.runtime.aot): the trainer slice on `pod.trainer_type`, one
rollout slice on `pod.rollout_type` (a single-host pod splits its one node's chips). Writes
DIR/compile.json (per role: chips, HBM capacity, resident and peak bytes per chip, whether it
fits; per program: XLA's memory and cost figures and an estimated time), prints a table, and
exits 1 naming the program and the bytes when a role does not fit. `--target=local` compiles for
this machine's own devices (a TPU VM); `--target=v5e:2x2` for one host of that topology.
With `--jobs=2` (the default) the two roles compile at once, each in its own process: the TPU
compiler runs one program at a time per process (two threads crash libtpu) and leaves cores idle
in its serial passes. The trainer has more to compile: the rollout role's process also compiles
the trainer's cost probes once its own programs are done, and hands their costs over in a file
(`--probes_out` / `--probes_in`, set by the parent). Needs libtpu for TPU topologies: pip install -e ".[tpu]".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from absl import app, flags

from dora_jax import cli

TARGET = flags.DEFINE_string(
    "target", "pod", "pod: the config's pod section; local: this machine's devices; or a topology such as v5e:2x4"
)
TRAIN_LENGTHS = flags.DEFINE_list(
    "train_lengths", [], "extra batch widths to compile the whole-batch train step for (the widest is always compiled)"
)
ESTIMATE_LENGTHS = flags.DEFINE_list(
    "estimate_lengths",
    None,
    "with model.scan_layers: trainer widths whose programs get cost estimates (probe compiles of 1 and "
    "2 unrolled blocks); default: the width nearest 4096",
)
ROLES = flags.DEFINE_list("roles", ["trainer", "rollout"], "roles to compile")
PROGRAMS = flags.DEFINE_list(
    "programs",
    None,
    "compile only the programs of these names (the part before '[', e.g. recompute,grad): a quick look at "
    "their memory and estimates; a role is then found not to fit, or nothing is said of its fit",
)
JOBS = flags.DEFINE_integer(
    "jobs", 2, "roles compiled at once, each in its own process (1: one after the other in this process)"
)
PROBES_OUT = flags.DEFINE_string(
    "probes_out", None, "after its roles, compile the trainer's cost probes and write their costs to this file"
)
ROLE_PROCESS = flags.DEFINE_bool(
    "role_process",
    False,
    "set by --jobs for the processes it starts: one role of several (--programs is checked by the parent)",
)
PROBES_IN = flags.DEFINE_string(
    "probes_in", None, "take the trainer's cost probes from this file (written by another tpu_compile process)"
)


def main(argv):
    del argv
    if not cli.OUT.value:
        raise app.UsageError("--out is required")
    unknown = set(ROLES.value) - {"trainer", "rollout"}
    if unknown:
        raise app.UsageError(f"--roles={','.join(ROLES.value)}: unknown {sorted(unknown)}; expected trainer, rollout")
    config_dict = cli.CONFIG.value
    if TARGET.value != "local":
        # The TPU compiler runs inside the CPU process: JAX must not look for TPU chips here.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    cli.prepare_devices(config_dict)
    from dora_jax.runtime import aot, run_config

    path = os.path.join(cli.OUT.value, "compile.json")

    def write(result: dict) -> None:  # after every role: a big model's roles take many minutes each
        os.makedirs(cli.OUT.value, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"config": cli.config_as_json(config_dict), **result}, f, indent=1)

    if JOBS.value < 1:
        raise app.UsageError(f"--jobs={JOBS.value}; expected 1 or more")
    if JOBS.value > 1 and len(ROLES.value) > 1 and TARGET.value != "local":  # a TPU VM's chips take one process
        try:
            run_config.parse(config_dict)  # a bad config is named once, here
        except ValueError as err:
            print(f"tpu_compile: {err}", file=sys.stderr)
            sys.exit(2)
        result = _roles_in_processes(ROLES.value, JOBS.value, write)
        if result is None:
            sys.exit(2)
        _finish(result, path, aot)
        return
    try:
        config = run_config.parse(config_dict)
        lengths = tuple(int(n) for n in TRAIN_LENGTHS.value)
        pod = config_dict.pod if "pod" in config_dict else None
        estimate = None if ESTIMATE_LENGTHS.value is None else [int(n) for n in ESTIMATE_LENGTHS.value]
        result = aot.compile_roles(
            config,
            pod,
            TARGET.value,
            train_lengths=lengths,
            estimate_lengths=estimate,
            roles=tuple(ROLES.value),
            on_role=write,
            probes_in=PROBES_IN.value,
            probes_out=PROBES_OUT.value,
            programs=PROGRAMS.value,
        )
    except (ValueError, RuntimeError) as err:
        print(f"tpu_compile: {err}", file=sys.stderr)
        sys.exit(2)
    write(result)
    _finish(result, path, aot)


def _finish(result: dict, path: str, aot) -> None:
    print(aot.table(result))
    print(f"wrote {path}")
    if (
        PROGRAMS.value is not None
        and not ROLE_PROCESS.value
        and (wrong := aot.unknown_programs(result, PROGRAMS.value))
    ):
        print(f"tpu_compile: {wrong}", file=sys.stderr)
        sys.exit(2)
    problems = aot.does_not_fit(result)
    for line in problems:
        print(f"tpu_compile: {line}", file=sys.stderr)
    sys.exit(1 if problems else 0)


def _roles_in_processes(roles: list[str], jobs: int, write) -> dict | None:
    """Each role compiled by `python -m dora_jax.tpu_compile --roles=ROLE` in a process of its own,
    `jobs` at a time, their progress lines prefixed with the role; their records merged in the
    order of `roles` (compile.json is rewritten as each finishes). None when one failed (its
    error has been printed)."""
    from dora_jax.runtime import aot

    base = [a for a in sys.argv[1:] if not a.startswith(("--roles", "--out", "--jobs", "--probes_", "--role_process"))]
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # each process loads libtpu
    records: dict[str, list] = {}
    failed = []
    lock = threading.Lock()
    merged = lambda: aot.result_of([r for role in roles for r in records.get(role, [])])  # noqa: E731
    # Both roles at once: the rollout's process compiles the trainer's cost probes after its own.
    os.makedirs(cli.OUT.value, exist_ok=True)
    probes = os.path.join(cli.OUT.value, "probes.json")
    share = {"trainer", "rollout"} <= set(roles[:jobs])
    if share and os.path.exists(probes):
        os.remove(probes)
    handover = {"trainer": [f"--probes_in={probes}"], "rollout": [f"--probes_out={probes}"]} if share else {}

    def compile_one(role: str) -> None:
        out = os.path.join(cli.OUT.value, f"role-{role}")
        argv = [
            sys.executable,
            "-m",
            "dora_jax.tpu_compile",
            *base,
            f"--roles={role}",
            f"--out={out}",
            "--jobs=1",
            "--role_process",
        ]
        argv += handover.get(role, [])
        child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        verdicts = []  # its own "tpu_compile: ..." lines: a failure's are printed, a misfit's the merge reports
        for line in child.stderr:
            if line.startswith("tpu_compile: "):
                verdicts.append(f"[{role}] {line}")
            else:
                print(f"[{role}] {line}", end="", file=sys.stderr, flush=True)
        code = child.wait()
        if role == "rollout" and share and not os.path.exists(probes):  # or the trainer would wait forever
            aot.write_probe_costs(probes, error=f"the rollout role's process exited with {code} first")
        if code not in (0, 1):  # 1: compiled, does not fit (the merged result says so)
            print("".join(verdicts), end="", file=sys.stderr, flush=True)
            with lock:
                failed.append(role)
            return
        with open(os.path.join(out, "compile.json")) as f:
            roles_done = json.load(f)["roles"]
        with lock:
            records[role] = roles_done
            write(merged())

    pending = list(roles)
    while pending:
        threads = [threading.Thread(target=compile_one, args=(role,)) for role in pending[:jobs]]
        pending = pending[jobs:]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failed:
        print(f"tpu_compile: --roles={','.join(failed)} failed (above)", file=sys.stderr)
        return None
    return merged()


def run() -> None:
    """The `python -m dora_jax.tpu_compile` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
