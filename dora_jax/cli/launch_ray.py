"""`python -m dora_jax.launch_ray --config=C --workdir=W [--address=auto|HOST:PORT|ray://...] [--config.x=y]`

The Ray placement: the same role processes as a pod or `launch_local` (`dora_jax.serve_coordinator`,
`dora_jax.trainer_worker`, `dora_jax.rollout_worker`), each run by a Ray actor that Ray places,
restarts and logs. Also as a Ray job: `ray job submit -- python -m dora_jax.launch_ray ...`.

- The coordinator: one actor on the driver's node (it needs no accelerator), serving gRPC on a
  port picked there; a restarted coordinator listens on the same port.
- The trainer slice and each rollout slice: a TPU slice placement group
  (`ray.util.tpu.slice_placement_group(topology, accelerator_version)`: one bundle per TPU host,
  the slice reserved whole, a multi-host slice through its `TPU-<type>-head` resource) and one
  actor per host; a slice of H > 1 hosts is one multi-controller JAX job over its own hosts
  (`--num_hosts`, `--host_id`, `--jax_coordinator` on host 0's node), exactly as on a pod.
- Each actor runs its role as a child process (SIGKILLed if the actor dies) and shares its fate:
  a role that exits with an error takes its actor down, Ray starts the actor again
  (`--max_restarts`) and retries its `run`, and the role rejoins the run as after a restart by
  `launch_local --max_restarts`: a rollout slice registers again, a trainer goes back to its
  checkpoint, a coordinator restores its state from the trainer's. A job stopped (`ray job
  stop`, Ctrl-C: the roles are stopped coordinator first) and submitted again on the same workdir
  resumes from its newest checkpoint.
- Slice types: `--trainer_type` / `--rollout_type` (TPU accelerator types, `launch/tpu_types.py`
  names), by default the config's `pod.trainer_type` / `pod.rollout_type`. On CPU
  (`mesh.fake_cpu_devices` > 0) the same placement groups are used over nodes that advertise
  fake TPU hosts (`fake_tpu_node_args`: the resources and labels Ray's TPU accelerator manager
  gives a TPU VM); each role then runs on `mesh size / hosts` fake XLA CPU devices. With no
  `--address` and no running cluster, a CPU run starts such a local cluster itself.
- Logs: each role's output is its actor's (`ray logs actor --id ...`, the dashboard, and this
  driver's console, prefixed by the actor's name); the ledger and metrics stay in the workdir.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags

from dora_jax import cli
from dora_jax.core import fs, tpu_slices
from dora_jax.transport import auth

try:
    import ray
    from ray._private.accelerators.tpu import TPUAcceleratorManager, get_chips_per_host
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
    from ray.util.tpu import slice_placement_group
except ImportError:  # the `ray` extra is optional; nothing else in the package imports Ray
    ray = None

ADDRESS = flags.DEFINE_string(
    "address", None, "Ray cluster: HOST:PORT, ray://HOST:10001 or 'auto'; default: the job's cluster, or a local one"
)
TRAINER_TYPE = flags.DEFINE_string("trainer_type", None, "TPU type of the trainer slice (default pod.trainer_type)")
ROLLOUT_TYPE = flags.DEFINE_string("rollout_type", None, "TPU type of each rollout slice (default pod.rollout_type)")
PLACEMENT_TIMEOUT_S = flags.DEFINE_float("placement_timeout_s", 600.0, "wait this long for the slices' nodes")
STOP_GRACE_S = 20.0
TRAINER_STOP_S = 120.0  # a stopped trainer finishes its step and saves a checkpoint


@dataclasses.dataclass(frozen=True)
class SlicePlan:
    """One slice to place: its role, TPU type and what each host runs on."""

    name: str  # "trainer" | "rollout_<i>"
    tpu_type: str  # e.g. "v5p-32"
    topology: str  # e.g. "2x2x4"
    accelerator_version: str  # Ray's name: "v4", "v5p", "v5litepod", "v6e"
    hosts: int
    chips_per_host: int
    devices_per_host: int  # JAX devices each host's process uses (fake CPU devices on CPU)


def slice_shape(tpu_type: str, field: str) -> tuple[str, str, int, int]:
    """(topology, Ray's accelerator version, hosts, chips per host) of a TPU type, by Ray's own
    arithmetic (what its slice placement group reserves)."""
    generation, chips = tpu_slices.generation_and_chips(tpu_type, field)
    topology = tpu_slices.topology(tpu_type, field)
    chips_per_host = get_chips_per_host(topology, generation)
    return topology, generation, max(1, chips // chips_per_host), min(chips, chips_per_host)


def plan_slice(name: str, tpu_type: str, mesh: dict, field: str) -> SlicePlan:
    """The placement of one slice whose mesh is `mesh`; a ValueError naming `field` when the type
    is unknown or the mesh does not split over its hosts."""
    topology, version, hosts, chips_per_host = slice_shape(tpu_type, field)
    size = 1
    for axis in mesh.values():
        size *= int(axis)
    if size % hosts:
        raise ValueError(f"{field}={tpu_type!r} has {hosts} hosts but the slice's mesh {mesh} has {size} devices")
    return SlicePlan(name, tpu_type, topology, version, hosts, chips_per_host, size // hosts)


def plan(config_dict, trainer_type: str | None, rollout_type: str | None) -> list[SlicePlan]:
    """Every slice of the run: the trainer first, then `rollout.num_slices` rollout slices."""
    pod = config_dict.get("pod") if hasattr(config_dict, "get") else None
    trainer_type = trainer_type or (pod and pod.get("trainer_type")) or ""
    rollout_type = rollout_type or (pod and pod.get("rollout_type")) or ""
    if not trainer_type or not rollout_type:
        raise ValueError(
            "--trainer_type and --rollout_type are needed (the config's pod section has none): TPU types such as "
            "v5p-32 (on CPU: the fake hosts to place the slices on, e.g. v4-8 for one host, v4-16 for two)"
        )
    mesh = config_dict.mesh
    slices = [plan_slice("trainer", trainer_type, dict(mesh.trainer), "--trainer_type")]
    for i in range(int(config_dict.rollout.num_slices)):
        slices.append(plan_slice(f"rollout_{i}", rollout_type, dict(mesh.rollout), "--rollout_type"))
    return slices


def fake_tpu_node_args(tpu_type: str, slice_name: str, host: int) -> dict:
    """`Cluster.add_node` arguments of one fake TPU host on a CPU machine: what Ray's TPU
    accelerator manager sets on a real TPU VM (a `TPU` resource per chip, `TPU-<type>-head` on
    worker 0, the `ray.io/tpu-*` labels, TPU_NAME / TPU_WORKER_ID naming the slice)."""
    _, _, _, chips_per_host = slice_shape(tpu_type, "tpu_type")
    resources = {"TPU": float(chips_per_host)}
    if host == 0:
        resources[f"TPU-{tpu_type}-head"] = 1.0
    return {
        "num_cpus": 1,
        "resources": resources,
        "labels": {
            "ray.io/tpu-slice-name": slice_name,
            "ray.io/tpu-worker-id": str(host),
            "ray.io/tpu-pod-type": tpu_type,
        },
        "env_vars": {"TPU_NAME": slice_name, "TPU_WORKER_ID": str(host)},
    }


def _pdeathsig() -> None:
    """In the child, before exec: SIGKILL when the actor's process dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RoleActor:
    """One role process (one host of a slice, or the coordinator), run by a Ray actor that shares
    its fate: `run` returns the role's exit status when it ends well and kills the actor when it
    fails, so that Ray restarts the actor and retries `run`."""

    def __init__(self, name: str, module: str, argv: list[str], env: dict[str, str], cwd: str):
        self.name, self.module, self.argv, self.env, self.cwd = name, module, argv, env, cwd
        self.child: subprocess.Popen | None = None
        self.stopping = False

    def node(self) -> dict:
        """Where this actor runs: node id and IP, and the TPU slice and worker of that node."""
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "slice": os.environ.get("TPU_NAME", ""),
            "host": os.environ.get("TPU_WORKER_ID", ""),
        }

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, extra_argv: list[str], credentials: list) -> int:
        """Starts the role (or joins it, when a call is submitted again to a live actor).
        `credentials`: [a reference to the role's variables in Ray's object store] (the run secret
        for the coordinator, the role's own token for the others), read here and handed to the
        role's environment: never a command line."""
        if self.child is not None and self.child.poll() is None:
            return self._wait()
        env = {k: v for k, v in os.environ.items() if k not in auth.CREDENTIAL_ENV}
        env.update(self.env)
        env.update(ray.get(credentials[0]))
        cwd = self.cwd if os.path.isdir(self.cwd) else os.getcwd()
        command = [sys.executable, "-m", f"dora_jax.{self.module}", *self.argv, *extra_argv]
        print(f"[{self.name}] {time.strftime('%H:%M:%S')} python -m dora_jax.{self.module}", flush=True)
        self.child = subprocess.Popen(command, env=env, cwd=cwd, preexec_fn=_pdeathsig)
        return self._wait()

    def _wait(self) -> int:
        code = self.child.wait()
        if code != 0 and not self.stopping:
            print(f"[{self.name}] exited with {code}: the actor goes down so that Ray restarts it", flush=True)
            os._exit(1)
        return code

    def stop(self) -> None:
        """SIGTERM to the role (the coordinator then stops the rollout workers)."""
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def pid(self) -> int:
        return os.getpid()


def _actor_class():
    return ray.remote(RoleActor)


def _role_env(plan: SlicePlan | None, platform_cpu: bool) -> dict[str, str]:
    if not platform_cpu:
        return {}
    devices = 1 if plan is None else plan.devices_per_host
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(kept + [f"--xla_force_host_platform_device_count={devices}"]),
    }


def namespace(workdir: str) -> str:
    """The Ray namespace of the run on `workdir`: its actors are named by role in it
    (`ray.get_actor("rollout_1", namespace=...)`), and two runs on one cluster do not collide."""
    return "dora_jax-" + hashlib.sha256(workdir.encode()).hexdigest()[:12]


def start_roles(slices: list[SlicePlan], common: list[str], *, max_restarts: int, cpu: bool) -> dict:
    """Places and starts every role; returns {name: RoleRun} with the coordinator first."""
    Role = _actor_class()
    options = dict(max_restarts=max_restarts, max_task_retries=-1, max_concurrency=2)
    here = ray.get_runtime_context().get_node_id()
    coordinator = Role.options(
        name="coordinator", num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False), **options
    ).remote("coordinator", "serve_coordinator", [*common], _role_env(None, cpu), os.getcwd())
    port = ray.get(coordinator.free_port.remote())
    address = f"{ray.get(coordinator.node.remote())['ip']}:{port}"
    secret = auth.new_secret()  # this launch's; it reaches the coordinator through the object store alone
    roles = {"coordinator": RoleRun(coordinator, [f"--port={port}"], ray.put({auth.SECRET_ENV: secret.hex()}))}
    for plan_ in sorted(slices, key=lambda p: -p.hosts):  # multi-host slices first: a one-host bundle may fit anywhere
        argv = [*common, f"--coordinator={address}"]
        if plan_.name != "trainer":
            argv.append(f"--slice_id={plan_.name.split('_')[1]}")
        principal = auth.TRAINER if plan_.name == "trainer" else auth.rollout(int(plan_.name.split("_")[1]))
        token = ray.put({auth.TOKEN_ENV: auth.role_token(secret, principal)})  # that role's alone
        roles.update(_start_slice(Role, plan_, argv, options, cpu, token))
    for run_ in roles.values():
        run_.submit()
    return roles


def _start_slice(Role, plan_: SlicePlan, argv: list[str], options: dict, cpu: bool, token) -> dict:
    """One slice: its TPU slice placement group, one actor per host (named `<slice>`, `<slice>_h1`,
    ...: host i runs on TPU worker i), each running the role."""
    handle = slice_placement_group(plan_.topology, plan_.accelerator_version, name=f"dora-{plan_.name}")
    ray.get(handle.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S.value)
    module = "trainer_worker" if plan_.name == "trainer" else "rollout_worker"
    names = [plan_.name] + [f"{plan_.name}_h{h}" for h in range(1, plan_.hosts)]
    actors = [
        Role.options(
            name=name,
            num_cpus=0,
            resources={"TPU": plan_.chips_per_host},
            scheduling_strategy=PlacementGroupSchedulingStrategy(handle.placement_group, bundle),
            **options,
        ).remote(name, module, argv, _role_env(plan_, cpu), os.getcwd())
        for name, bundle in zip(names, _bundles_by_host(handle.placement_group, plan_.hosts))
    ]
    host_args = _host_args(actors, plan_.hosts, cpu)
    return {name: RoleRun(actor, args, token) for name, actor, args in zip(names, actors, host_args)}


def _tpu_worker_id() -> int:
    return int(TPUAcceleratorManager.get_current_node_tpu_worker_id() or 0)


def _bundles_by_host(group, hosts: int) -> list[int]:
    """The placement group's bundle index of each TPU host of the slice, host 0 first: bundle
    order is not worker order, and a slice's JAX job numbers its processes by worker id."""
    if hosts == 1:
        return [0]
    probe = ray.remote(num_cpus=0)(_tpu_worker_id)
    ids = ray.get(
        [probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, b)).remote() for b in range(hosts)]
    )
    if sorted(ids) != list(range(hosts)):
        raise RuntimeError(f"the slice's hosts report TPU worker ids {ids}; expected 0..{hosts - 1}")
    return [ids.index(h) for h in range(hosts)]


def _host_args(actors: list, hosts: int, cpu: bool) -> list[list[str]]:
    """Each host's flags of a multi-host slice: on TPU, `--num_hosts` alone (JAX finds the hosts and
    their ids itself, as on a pod); on CPU also `--host_id` and the job's coordinator on host 0's
    node."""
    if hosts == 1:
        return [[]]
    if not cpu:
        return [[f"--num_hosts={hosts}"] for _ in actors]
    host0 = f"{ray.get(actors[0].node.remote())['ip']}:{ray.get(actors[0].free_port.remote())}"
    return [[f"--num_hosts={hosts}", f"--host_id={h}", f"--jax_coordinator={host0}"] for h in range(hosts)]


@dataclasses.dataclass
class RoleRun:
    """One role's actor and its `run` call (submitted again when the actor was killed by hand:
    Ray retries a call by itself only when the actor's process died on its own)."""

    actor: object
    args: list[str]
    credentials: object  # a reference to the role's credential variables in the object store
    ref: object = None
    resubmitted: int = 0

    def submit(self) -> None:
        self.ref = self.actor.run.remote(self.args, [self.credentials])


def _collect(runs: dict, name: str, outcome: dict, stop: dict, max_restarts: int) -> None:
    """Records a finished `run`; a killed actor's call is submitted again (it waits for the
    restarted actor) until its restarts are spent."""
    run_ = runs[name]
    try:
        outcome[name] = ray.get(run_.ref)
    except ray.exceptions.RayActorError as err:
        if run_.resubmitted < max_restarts:
            run_.resubmitted += 1
            print(f"[launch_ray] {name}'s actor died ({type(err).__name__}); running its role again", flush=True)
            run_.submit()
            return
        outcome[name] = f"failed: {type(err).__name__}"
        stop["signal"] = stop["signal"] or f"{name} failed"
    except ray.exceptions.RayError as err:  # the node is gone, or the call could not run
        outcome[name] = f"failed: {type(err).__name__}"
        stop["signal"] = stop["signal"] or f"{name} failed"


def supervise(runs: dict, stop: dict, timeout_s: float, max_restarts: int) -> dict:
    """Waits until the trainer's role ends (or a role fails past its restarts, a stop signal, the
    timeout); then stops the rest, coordinator first. Returns each role's exit status or error."""
    outcome: dict[str, object] = {}
    deadline = time.monotonic() + timeout_s
    while "trainer" not in outcome and stop["signal"] is None and time.monotonic() < deadline:
        pending = {r.ref: n for n, r in runs.items() if n not in outcome}
        done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
        for ref in done:
            _collect(runs, pending[ref], outcome, stop, max_restarts)
    if outcome.get("trainer") == 0:  # the coordinator stops the workers by itself
        _wait_all(runs, outcome, STOP_GRACE_S)
    # Stopped early: the trainer first (it checkpoints after its step, with the coordinator's
    # snapshot), then the coordinator (it stops the rollout workers), then whatever is left.
    order = ["trainer", "coordinator", *[n for n in runs if n not in ("trainer", "coordinator")]]
    for name in order:
        if name not in outcome:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(runs[name].actor.stop.remote(), timeout=10)
            if name == "trainer":
                _wait_all({name: runs[name]}, outcome, TRAINER_STOP_S)
    _wait_all(runs, outcome, STOP_GRACE_S)
    for run_ in runs.values():
        ray.kill(run_.actor, no_restart=True)
    return outcome


def _wait_all(runs: dict, outcome: dict, seconds: float) -> None:
    pending = {r.ref: n for n, r in runs.items() if n not in outcome}
    done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=seconds) if pending else ([], [])
    for ref in done:
        with contextlib.suppress(ray.exceptions.RayError):
            outcome[pending[ref]] = ray.get(ref)


def placement(runs: dict) -> dict:
    """Where each role's actor runs (node, TPU slice name and worker id), for the summary."""
    return {name: ray.get(run_.actor.node.remote(), timeout=30) for name, run_ in runs.items()}


def _connect(address: str | None, cpu: bool, slices: list[SlicePlan], space: str):
    """Joins the cluster; with no address on CPU and none running, starts a local one whose nodes
    are the slices' fake TPU hosts (returned, to shut it down at the end)."""
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or None, namespace=space, log_to_driver=True)
        return None
    if not cpu:
        ray.init(address="auto", namespace=space)
        return None
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for plan_ in slices:
        for host in range(plan_.hosts):
            cluster.add_node(**fake_tpu_node_args(plan_.tpu_type, f"local-{plan_.name}", host))
    ray.init(address=cluster.address, namespace=space)
    return cluster


def main(argv):
    del argv
    if ray is None:
        raise app.UsageError('launch_ray needs Ray: pip install -e ".[ray]"')
    workdir = cli.WORKDIR.value
    if not workdir:
        raise app.UsageError("--workdir is required")
    from dora_jax.runtime import run_config

    config = run_config.parse(cli.CONFIG.value)  # a bad config fails here, before anything starts
    try:
        slices = plan(cli.CONFIG.value, TRAINER_TYPE.value, ROLLOUT_TYPE.value)
    except ValueError as err:
        raise app.UsageError(str(err)) from None
    fs.check_access(workdir)
    cpu = int(config.mesh.fake_cpu_devices) > 0
    config_args = [
        a if not a.startswith("--config=") else f"--config={os.path.abspath(a[9:])}"
        for a in cli.config_flags(sys.argv[1:])
    ]
    common = [*config_args, f"--workdir={workdir}"]
    space = namespace(workdir)
    cluster = _connect(ADDRESS.value, cpu, slices, space)
    stop = {"signal": None}
    previous = {
        s: signal.signal(s, lambda signum, _f: stop.update(signal=signum)) for s in (signal.SIGINT, signal.SIGTERM)
    }
    start = time.perf_counter()
    try:
        roles = start_roles(slices, common, max_restarts=cli.flag_or(cli.MAX_RESTARTS, 3), cpu=cpu)
        where = placement(roles)
        print(f"[launch_ray] started {len(roles)} role actors in namespace {space!r}", flush=True)
        outcome = supervise(roles, stop, cli.flag_or(cli.TIMEOUT_S, 7200.0), cli.flag_or(cli.MAX_RESTARTS, 3))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    summary = {
        "workdir": workdir,
        "roles": outcome,
        "placement": where,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    ok = outcome.get("trainer") == 0
    if fs.exists(fs.join(workdir, "ledger.jsonl")):
        from dora_jax.cli.audit import audit_workdir

        report = audit_workdir(workdir)
        summary.update({"audit_ok": report.ok, "audit": report.summary()})
        ok = ok and report.ok
    print(json.dumps(summary, indent=1, default=str), flush=True)
    sys.exit(0 if ok else 1)


def run() -> None:
    app.run(main)
