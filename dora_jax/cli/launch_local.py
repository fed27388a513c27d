"""`python -m dora_jax.launch_local --config=configs/smoke.py --workdir=DIR [--config.x=y ...]`

Runs one job as separate processes on this machine, as a pod would: the coordinator
(`dora_jax.serve_coordinator`), one trainer (`dora_jax.trainer_worker`) and `rollout.num_slices`
rollout workers (`dora_jax.rollout_worker`), each on its own fake CPU devices
(JAX_PLATFORMS=cpu, XLA_FLAGS=--xla_force_host_platform_device_count=<its mesh's size>), talking
gRPC on localhost (the coordinator and the transfer servers listen on 127.0.0.1 only); versions go
through DIR/versions. Every call to the coordinator carries a role token: the launcher makes a
run secret and a token per role in a private temporary directory (mode 0700, files 0600, removed
at the end), hands the coordinator the secret and every other role its own token by environment
variables naming those files (dora_jax/transport/auth.py); `--tls` adds a per-run CA and the
coordinator's certificate (off by default: nothing leaves the loopback interface). The trainer
runs the SFT cold start (others wait for its first version). When the trainer has done
`num_steps` it tells the coordinator, which stops the workers and exits; the launcher tears
everything down (also on Ctrl-C or a failure: each child is its own process group, killed whole,
and dies with the launcher), audits DIR/ledger.jsonl
and prints the summary. Logs: DIR/logs/<role>.log (with a gs:// DIR written locally while the job
runs, then copied there). Exit status: 0 when the trainer finished and the audit is clean.

`--hosts_per_slice=H` runs every rollout slice as H processes that form one multi-controller JAX
job (`jax.distributed.initialize` over that slice's processes only, CPU collectives over gloo):
`mesh.rollout` then spans H processes of size/H fake devices each, and process 0 of the slice
alone talks to the coordinator, mirroring every engine call to the others. `--trainer_hosts=H`
does the same for the trainer (every process takes the same batch and runs the same step).
Logs of the extra processes: DIR/logs/<role>_h<i>.log.

`--kill_slice=N --kill_after_s=T` kills rollout worker N (all of its processes) with SIGKILL, T
seconds or more after the coordinator starts dispatching, at the worker's first step with requests
in its slots (the launcher drops a file the worker looks for before each step: DORA_FAULTS
`slice_kill_file`, dora_jax/runtime/faults.py; the worker SIGKILLs itself, the launcher its other
hosts' processes). Those requests are neither finished nor exported, so the slice surely dies
holding work. Fault injection: the run must finish, its requests re-dispatched, the audit clean.

Run again on the workdir of a run that was stopped or killed (every process at once, as a spot
preemption does), it resumes that run: the trainer restores its newest checkpoint
(`checkpoint.every_steps`), the coordinator the state saved in it, in-flight requests continue
under their own version from their tokens so far, and the ledger's `resume` event voids what the
lost processes wrote after the checkpoint (dora_jax.serve_coordinator, dora_jax.trainer_worker).
With `--max_restarts=N` the launcher restarts a dead role by itself: a restarted trainer registers
with the running coordinator, which goes back to the trainer's checkpoint (the rollout workers drop
their requests and rejoin, engines warm); a restarted coordinator listens on the same port, the
trainer goes back to its checkpoint and the workers rejoin; a restarted rollout worker rejoins.
`--kill_role=trainer|coordinator --kill_after_step=S` SIGKILLs that role once the checkpoint of step
S exists (fault injection).

`--trainer_cores=N` disaggregates the cores as a pod disaggregates chips: the trainer's processes
run on the first N cores the launcher may use, the rollout workers' on the others (CPU affinity,
set in each child before it starts, so every thread XLA creates inherits it); the coordinator runs
anywhere. Without it every process competes for every core.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from dora_jax import cli
from dora_jax.core import fs
from dora_jax.runtime.cores import role_cores
from dora_jax.transport import auth

HOSTS_PER_SLICE = flags.DEFINE_integer(
    "hosts_per_slice",
    1,
    "processes per rollout slice (> 1: each slice one "
    "multi-controller JAX job over them); mesh.rollout's size must divide by it",
)
TRAINER_HOSTS = flags.DEFINE_integer(
    "trainer_hosts",
    1,
    "processes of the trainer slice (> 1: one multi-controller JAX job); mesh.trainer's size must divide by it",
)
KILL_SLICE = flags.DEFINE_integer("kill_slice", -1, "fault injection: SIGKILL this rollout worker mid-run")
KILL_AFTER_S = flags.DEFINE_float(
    "kill_after_s", 30.0, "kill --kill_slice this long after dispatch starts, at its next step with requests"
)
KILL_ROLE = flags.DEFINE_enum(
    "kill_role",
    None,
    ["trainer", "coordinator"],
    "fault injection: SIGKILL this role's process once --kill_after_step steps are checkpointed",
)
KILL_AFTER_STEP = flags.DEFINE_integer("kill_after_step", 2, "see --kill_role")
TLS = flags.DEFINE_bool(
    "tls",
    False,
    "serve the coordinator over TLS with a per-run CA the clients pin (off by default: on loopback only the "
    "machine's own users can reach it; role tokens are checked either way)",
)
TRAINER_CORES = flags.DEFINE_integer(
    "trainer_cores",
    0,
    "disaggregated cores, as a pod gives the trainer and the rollout slices their own chips: the trainer's "
    "processes run on the first N cores this launcher may use, the rollout workers' on the rest (CPU "
    "affinity, inherited by every thread XLA starts); the coordinator on all. 0: every process on every core",
)


def main(argv):
    del argv
    workdir = cli.WORKDIR.value
    if not workdir:
        raise app.UsageError("--workdir is required")
    from dora_jax.runtime import run_config

    config = run_config.parse(cli.CONFIG.value)  # a bad config fails here, before anything starts
    fs.check_access(workdir)
    if fs.exists(fs.join(workdir, "ledger.jsonl")):
        _print(f"{workdir} holds a run (ledger.jsonl): resuming it from its newest checkpoint")
    if config.mesh.time_shared:
        raise app.UsageError("mesh.time_shared=True: launch_local gives every process its own devices")
    global _CORES
    if TRAINER_CORES.value:  # (os.sched_getaffinity is Linux's)
        try:
            _CORES = role_cores(TRAINER_CORES.value, sorted(os.sched_getaffinity(0)))
        except ValueError as err:
            raise app.UsageError(str(err)) from None
    trainer = _per_host("trainer_hosts", TRAINER_HOSTS.value, "mesh.trainer", dict(config.mesh.trainer))
    rollout = _per_host("hosts_per_slice", HOSTS_PER_SLICE.value, "mesh.rollout", dict(config.mesh.rollout))
    start = time.perf_counter()
    outcome = launch(config, workdir, cli.config_flags(sys.argv[1:]), trainer=trainer, rollout=rollout)
    wall = time.perf_counter() - start
    summary = {
        "workdir": workdir,
        "processes": outcome["processes"],
        "wall_s": round(wall, 1),
        "trainer_exit": outcome["trainer_exit"],
        "killed": outcome["killed"],
        "restarts": outcome["restarts"],
    }
    ok = outcome["trainer_exit"] == 0
    if fs.exists(fs.join(workdir, "ledger.jsonl")):
        from dora_jax.cli.audit import audit_workdir

        report = audit_workdir(workdir)
        summary.update({"audit_ok": report.ok, "audit": report.summary()})
        ok = ok and report.ok
    print(json.dumps(summary, indent=1), flush=True)
    sys.exit(0 if ok else 1)


_CORES: dict[str, list[int]] = {}  # role ("trainer", "rollout") -> the cores its processes may run on


def _per_host(flag: str, hosts: int, field: str, shape: dict) -> tuple[int, int]:
    """(hosts, devices per host) of a slice whose whole mesh is `shape`; a clear error otherwise."""
    from dora_jax.parallel import sharding

    size = sharding.mesh_size(shape)
    if hosts < 1:
        raise app.UsageError(f"--{flag}={hosts}; expected >= 1")
    if size % hosts:
        axis, length = next(iter(shape.items()), ("tensor", 1))
        raise app.UsageError(
            f"--{flag}={hosts}: {field}={shape} has {size} devices, which do not split over "
            f"{hosts} processes; give the slice a multiple of {hosts} devices, e.g. "
            f"--config.{field}.{axis}={length * hosts}"
        )
    return hosts, size // hosts


def launch(
    config, workdir: str, config_flags: list[str], *, trainer: tuple[int, int], rollout: tuple[int, int]
) -> dict:
    """Starts every process, supervises them until the trainer ends, tears them down. With
    --max_restarts a dead single-process role is started again in place; a dead role that spans
    several processes relaunches the whole job (a resume). `trainer` and `rollout` are (hosts,
    devices per host) of the trainer slice and of each rollout slice."""
    outcome = {"trainer_exit": None, "killed": None, "processes": 0, "restarts": 0}
    private = tempfile.mkdtemp(prefix="dora_run_auth_")  # 0700: the run secret and role tokens
    try:
        credentials = auth.make_run_credentials(private, config.rollout.num_slices, tls=TLS.value)
        return _launch_until_done(config, workdir, config_flags, trainer, rollout, outcome, credentials)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _launch_until_done(config, workdir, config_flags, trainer, rollout, outcome, credentials) -> dict:
    max_restarts = cli.flag_or(cli.MAX_RESTARTS, 0)
    while True:
        stopped = _launch_once(config, workdir, config_flags, trainer, rollout, outcome, credentials)
        if stopped or outcome["trainer_exit"] == 0 or outcome["restarts"] >= max_restarts:
            return outcome
        outcome["restarts"] += 1
        outcome["trainer_exit"] = None
        _print(
            f"restart {outcome['restarts']} of {max_restarts}: launching the job again on {workdir} "
            "(it resumes from its newest checkpoint)"
        )


def _launch_once(
    config, workdir: str, config_flags: list[str], trainer, rollout, outcome: dict, credentials: auth.RunCredentials
) -> bool:
    """One launch of every process until the trainer ends or something fails; True when stopped
    by a signal."""
    logs = tempfile.mkdtemp(prefix="dora_launch_logs_") if fs.is_remote(workdir) else fs.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    port = cli.PORT.value or _free_port()
    address = f"127.0.0.1:{port}"
    common = [*config_flags, f"--workdir={workdir}"]
    children: dict[str, subprocess.Popen] = {}
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    clients = [*common, f"--coordinator={address}", "--transfer_host=127.0.0.1"]
    roles = {  # name -> (module, args, (hosts, devices per host))
        "coordinator": (
            "serve_coordinator",
            [*common, f"--port={port}", "--host=127.0.0.1", *(["--trace_lengths"] if cli.TRACE_LENGTHS.value else [])],
            (1, 1),
        ),
        "trainer": ("trainer_worker", clients, trainer),
    }
    environments = {"coordinator": credentials.environment(None), "trainer": credentials.environment(auth.TRAINER)}
    for sid in range(config.rollout.num_slices):
        roles[f"rollout_{sid}"] = ("rollout_worker", [*clients, f"--slice_id={sid}"], rollout)
        environments[f"rollout_{sid}"] = credentials.environment(auth.rollout(sid))
    if 0 <= KILL_SLICE.value < config.rollout.num_slices and outcome["killed"] is None:
        environments[f"rollout_{KILL_SLICE.value}"].update(_kill_file_faults(logs))

    def respawn(name: str) -> bool:
        """Starts a dead single-process role again (a restarted coordinator listens on the same
        port, so the others reconnect); False when no restart is left or the role spans hosts
        (`name` may be one of its extra hosts' processes, rollout_<i>_h<j>, which `roles` lacks)."""
        if name not in roles:
            return False
        module, args, hosts_devices = roles[name]
        if outcome["restarts"] >= cli.flag_or(cli.MAX_RESTARTS, 0) or hosts_devices[0] > 1:
            return False
        outcome["restarts"] += 1
        _print(f"restart {outcome['restarts']} of {cli.flag_or(cli.MAX_RESTARTS, 0)}: starting {name} again")
        children[name] = _spawn(name, module, args, hosts_devices[1], logs, environments[name])
        return True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for name, (module, args, hosts_devices) in roles.items():
            _spawn_slice(children, name, module, args, hosts_devices, logs, environments[name])
        outcome["processes"] = len(children)
        _print(f"started {len(children)} processes (coordinator at {address}); logs in {logs}")
        _supervise(children, workdir, logs, outcome, stop, config.num_steps, respawn)
    finally:
        _teardown(children)
        if fs.is_remote(workdir):
            fs.copy_dir(logs, fs.join(workdir, "logs"))
            shutil.rmtree(logs, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stop["signal"] is not None:
        _print(f"interrupted by signal {stop['signal']}; every process was stopped")
    return stop["signal"] is not None


def _supervise(children: dict, workdir: str, logs: str, outcome: dict, stop: dict, num_steps: int, respawn) -> None:
    deadline = time.monotonic() + cli.flag_or(cli.TIMEOUT_S, 7200.0)
    dispatch_t, told, reported, exits_seen = None, False, -1, set()
    follower = _FirstDispatch(fs.join(workdir, "ledger.jsonl"))
    while stop["signal"] is None:
        if children["trainer"].poll() is not None:
            code = children["trainer"].returncode
            if code != 0:
                _print(f"the trainer exited with {code}:\n" + _tail(logs, "trainer"))
                if respawn("trainer"):
                    continue
            outcome["trainer_exit"] = code
            return
        code = children["coordinator"].poll()
        if code not in (None, 0):  # 0: the trainer called Finish and is about to exit too
            _print(f"the coordinator exited with {code}:\n" + _tail(logs, "coordinator"))
            if respawn("coordinator"):
                continue
            return
        for name, child in list(children.items()):
            if name.startswith("rollout") and child.poll() not in (None, 0) and respawn(name):
                continue
            if name.startswith("rollout") and child.poll() not in (None, 0) and name not in exits_seen:
                exits_seen.add(name)
                _print(
                    f"{name} exited with {child.returncode} (the coordinator re-dispatches its work):\n"
                    + _tail(logs, name, 5)
                )
        # Fault injection only into a running job: the slice is told to die (the file), then its
        # other hosts' processes follow once it has.
        victims = _slice_processes(children, f"rollout_{KILL_SLICE.value}")
        if KILL_SLICE.value >= 0 and outcome["killed"] is None and code is None:
            kill_file = _kill_file(logs)
            if dispatch_t is None and follower.poll():
                dispatch_t = time.monotonic()
            if dispatch_t is not None and not told and time.monotonic() - dispatch_t > KILL_AFTER_S.value:
                open(kill_file, "w").close()
                told = True
            if told and not os.path.exists(kill_file):  # the worker took it: it is dying mid-step
                for victim in victims:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(victim.pid, signal.SIGKILL)
                outcome["killed"] = (
                    f"rollout_{KILL_SLICE.value} (SIGKILL at its first step with requests in its slots, "
                    f"{time.monotonic() - dispatch_t:.1f}s after the first dispatch)"
                )
                _print(f"killed {outcome['killed']}")
        steps = _steps_done(workdir)
        if (
            KILL_ROLE.value
            and outcome["killed"] is None
            and code is None
            and _checkpointed(workdir) >= KILL_AFTER_STEP.value
        ):
            os.killpg(children[KILL_ROLE.value].pid, signal.SIGKILL)
            outcome["killed"] = f"{KILL_ROLE.value} (SIGKILL after the checkpoint of step {_checkpointed(workdir)})"
            _print(f"killed {outcome['killed']}")
        if steps != reported and steps % 5 == 0:
            reported = steps
            _print(f"trainer step {steps}/{num_steps}")
        if time.monotonic() > deadline:
            _print(f"giving up after {cli.flag_or(cli.TIMEOUT_S, 7200.0):.0f}s")
            return
        time.sleep(0.5)


def _spawn_slice(
    children: dict, name: str, module: str, args: list[str], hosts_devices: tuple[int, int], logs: str, env: dict
) -> None:
    """One slice: a single process `name`, or `hosts` processes (`name`, `name`_h1, ...) joined into
    one JAX job through their own jax.distributed coordinator (on process 0's free port)."""
    hosts, devices = hosts_devices
    if hosts == 1:
        children[name] = _spawn(name, module, args, devices, logs, env)
        return
    jax_coordinator = f"127.0.0.1:{_free_port()}"
    for host in range(hosts):
        host_name = name if host == 0 else f"{name}_h{host}"
        children[host_name] = _spawn(
            host_name,
            module,
            [*args, f"--num_hosts={hosts}", f"--host_id={host}", f"--jax_coordinator={jax_coordinator}"],
            devices,
            logs,
            env,
        )


def _kill_file(logs: str) -> str:
    return os.path.join(logs, f"kill_rollout_{KILL_SLICE.value}")


def _kill_file_faults(logs: str) -> dict:
    """The kill slice's DORA_FAULTS: this launcher's own faults plus `slice_kill_file` (a file
    of this launch's logs, none there yet)."""
    path = _kill_file(logs)
    if "," in path:
        raise app.UsageError(f"--kill_slice: the logs directory {logs!r} holds a comma, which DORA_FAULTS cannot carry")
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)  # a stopped run's, which would kill the slice at its first step
    faults = [f for f in os.environ.get("DORA_FAULTS", "").split(",") if f.strip()]
    return {"DORA_FAULTS": ",".join([*faults, f"slice_kill_file={path}"])}


def _slice_processes(children: dict, name: str) -> list[subprocess.Popen]:
    return [child for n, child in children.items() if n == name or n.startswith(f"{name}_h")]


def _spawn(name: str, module: str, args: list[str], devices: int, logs: str, role_env: dict) -> subprocess.Popen:
    """`role_env`: the role's credentials (variables naming its files; never their contents)."""
    env = {k: v for k, v in os.environ.items() if k not in auth.CREDENTIAL_ENV}  # no other run's credentials
    env.update(role_env)
    env["JAX_PLATFORMS"] = "cpu"
    flags_ = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags_ + [f"--xla_force_host_platform_device_count={devices}"])
    cores = _CORES.get(name.split("_")[0])
    log = open(os.path.join(logs, f"{name}.log"), "a")  # a resumed run's logs follow the lost run's
    pinned = f" on cores {cores}" if cores else ""
    log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} python -m dora_jax.{module}{pinned}\n")
    log.flush()
    return subprocess.Popen(
        [sys.executable, "-m", f"dora_jax.{module}", *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: _in_child(cores),
    )


def _in_child(cores: list[int] | None) -> None:
    """In the child, before exec: SIGKILL when the launcher dies, however it dies (Linux prctl
    PDEATHSIG), and its cores (every thread it starts inherits them)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if cores:
        os.sched_setaffinity(0, cores)


_STOP_GRACE_S = 10.0


def _teardown(children: dict) -> None:
    """The coordinator first (it tells the workers to stop; they get `_STOP_GRACE_S` to stop by
    themselves and write their timelines), then whatever is left, group by group."""
    order = ["coordinator"] + [n for n in children if n != "coordinator"]
    grace = None
    for name in order:
        child = children.get(name)
        if child is not None and child.poll() is None:
            if name != "coordinator":
                grace = grace or time.monotonic() + _STOP_GRACE_S
                if _wait(child, max(grace - time.monotonic(), 0.0)):
                    continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            if name == "coordinator":
                _wait(child, 20)
    for name in order:
        child = children.get(name)
        if child is None:
            continue
        if not _wait(child, 15):
            _print(f"{name} ignored SIGTERM; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # its reward workers and anything else in its group
        child.wait()


def _wait(child: subprocess.Popen, seconds: float) -> bool:
    try:
        child.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _FirstDispatch:
    """Follows the ledger as it grows until the coordinator's first dispatch."""

    def __init__(self, path: str):
        self._path, self._offset, self.dispatched = path, 0, False

    def poll(self) -> bool:
        if not self.dispatched:
            with contextlib.suppress(OSError):
                data = fs.read_bytes(self._path, self._offset)
                complete = data[: data.rfind(b"\n") + 1]
                self._offset += len(complete)
                self.dispatched = b'"ev":"dispatch"' in complete
        return self.dispatched


def _steps_done(workdir: str) -> int:
    path = fs.join(workdir, "metrics.jsonl")
    with contextlib.suppress(OSError), fs.open(path) as f:  # training rows, not evaluation rows
        return sum(1 for line in f if '"reward_mean":' in line)
    return 0


def _checkpointed(workdir: str) -> int:
    """The newest finalised checkpoint step (orbax names it by its number), or -1."""
    with contextlib.suppress(OSError):
        return max((int(name) for name in fs.listdir(fs.join(workdir, "checkpoints")) if name.isdigit()), default=-1)
    return -1


def _tail(logs: str, name: str, lines: int = 20) -> str:
    path = os.path.join(logs, f"{name}.log")
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    return ""


def _print(message: str) -> None:
    print(f"[launch_local] {message}", file=sys.stderr, flush=True)


def run() -> None:
    """The `python -m dora_jax.launch_local` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
