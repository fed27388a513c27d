"""Create, set up, run, watch and delete the TPU VMs an experiment config's `pod` section describes.

    python launch/tpu.py create --config=configs/qwen2_5_7b_dapo.py [--dry-run]
    python launch/tpu.py setup  --config=configs/qwen2_5_7b_dapo.py      # tree, Python 3.12 uv env, jax[tpu], package
    python launch/tpu.py run    --config=configs/qwen2_5_7b_dapo.py [--workdir=gs://...] [--config.X=Y] [--nowait]
    python launch/tpu.py wait   --config=configs/qwen2_5_7b_dapo.py      # until every role has exited; reports each
    python launch/tpu.py logs   --config=configs/qwen2_5_7b_dapo.py [--lines=50]
    python launch/tpu.py ssh    --config=configs/qwen2_5_7b_dapo.py [--node=NAME] [--worker=0] [--command='...']
    python launch/tpu.py stop   --config=configs/qwen2_5_7b_dapo.py      # kill the role processes
    python launch/tpu.py status --config=configs/qwen2_5_7b_dapo.py
    python launch/tpu.py delete --config=configs/qwen2_5_7b_dapo.py

`run` starts every role detached and then waits (as `wait` does) until every role process has
exited, printing each role's state as it changes and, at the end, each one's exit status; it exits
non-zero naming the roles that failed or were killed. `--nowait` returns once they are started.

`--dry-run` prints every command (gcloud, and the local packing step) instead of running it. The
config is validated before any gcloud call (`launch.pod.from_config`, then `dora_jax.runtime.run_config.parse`
unless `--nocheck_run_config`); `--config.X=Y` overrides apply here and are forwarded to every role.
Every command goes through one `Shell`, which either prints or runs it.

Security (docs/security.md): `create` puts the nodes on `pod.network` with no public IP, the run's
tag and `pod.service_account`, after a firewall rule opening the run's ports between its VMs only;
`run` makes a fresh run secret and role tokens (and with `pod.tls` a CA and the coordinator's
certificate) in a private local directory, copies each node only its roles' files, and removes the
local copy. No printed or run command holds the secret or a token (a dry run makes them too, to
show the commands, and throws them away).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

if __package__ in (None, ""):  # run as `python launch/tpu.py`: make the `launch` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch import commands  # noqa: E402
from launch import pod as pod_lib
from launch.pod import Pod  # noqa: E402

ACTIONS = ("create", "setup", "run", "wait", "logs", "ssh", "stop", "status", "delete")
REPO_ROOT = Path(__file__).resolve().parents[1]
COORDINATOR_IP_DRY_RUN = "TRAINER_WORKER0_IP"  # stands in for the IP a dry run cannot look up


class Shell:
    """The one place commands run: printed (dry run) or run with subprocess; all are recorded."""

    def __init__(self, dry_run: bool, out: TextIO = sys.stdout):
        self.dry_run = dry_run
        self.out = out
        self.commands: list[list[str]] = []

    def run(self, argv: Sequence[str]) -> None:
        self.commands.append(list(argv))
        if self.dry_run:
            print(shlex.join(argv), file=self.out)
        else:
            print(f"+ {shlex.join(argv)}", file=self.out, flush=True)
            subprocess.run(list(argv), check=True)

    def capture(self, argv: Sequence[str], dry_run_value: str) -> str:
        """The command's stripped stdout; `dry_run_value` in a dry run."""
        self.commands.append(list(argv))
        if self.dry_run:
            print(shlex.join(argv), file=self.out)
            return dry_run_value
        return subprocess.run(list(argv), check=True, capture_output=True, text=True).stdout.strip()

    def note(self, text: str) -> None:
        print(f"# {text}", file=self.out, flush=True)


def source_files(root: Path) -> list[str]:
    """The tree as git sees it: tracked and untracked-but-not-ignored files (uncommitted edits too)."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return sorted(f for f in listed.split("\0") if f and (root / f).is_file())


def pack(root: Path, archive: str, shell: Shell) -> None:
    shell.note(f"pack {root} (git ls-files --cached --others --exclude-standard) into {archive}")
    if shell.dry_run:
        return
    names = source_files(root)
    with tarfile.open(archive, "w:gz") as tar:
        for name in names:
            tar.add(root / name, arcname=name)
    # Untracked files that .gitignore does not exclude travel too: say how much went.
    shell.note(f"packed {len(names)} files, {os.path.getsize(archive) / 1e6:.1f} MB")


def remote_config_path(config_path: str, root: Path = REPO_ROOT) -> str:
    """The config file's path inside the tree the pod gets (every role starts in ~/dora_jax)."""
    path = Path(config_path).resolve()
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        raise ValueError(
            f"--config={config_path} is outside the source tree {root}; the pod gets a copy of the "
            "tree, so put the config under configs/"
        ) from None


def wait_for_end(
    pod: Pod, shell: Shell, poll_s: float = 60.0, *, max_failed_polls: int = 10, sleep: Callable = time.sleep
) -> list[commands.RoleState]:
    """Polls every node's role processes until none is running, printing each role's state when it
    changes; returns the final states, or raises SystemExit naming the roles that failed (a non-zero
    exit, or gone: killed without an exit status). An ssh that fails is retried at the next poll,
    `max_failed_polls` times in a row at most."""
    if shell.dry_run:
        for argv in commands.roles(pod):
            shell.capture(argv, "")
        shell.note(f"then every {poll_s:g} s the same, until no role runs; then each role's exit status")
        return []
    shown: dict[tuple[str, str], str] = {}
    failed_polls = 0
    while True:
        states: list[commands.RoleState] = []
        try:
            for argv in commands.roles(pod):
                states += commands.parse_roles(shell.capture(argv, ""))
            failed_polls = 0
        except (subprocess.CalledProcessError, OSError) as err:
            failed_polls += 1
            if failed_polls >= max_failed_polls:
                raise SystemExit(
                    f"launch/tpu.py: {failed_polls} polls of the pod failed in a row; last: {err}"
                ) from None
            shell.note(f"poll failed ({err}); trying again in {poll_s:g} s")
            sleep(poll_s)
            continue
        if not states:
            raise SystemExit(f"launch/tpu.py: no role process on the nodes of {pod.name}: was `run` called?")
        for state in states:
            if shown.get((state.host, state.name)) != str(state):
                shown[(state.host, state.name)] = str(state)
                shell.note(str(state))
        if not any(state.state == "running" for state in states):
            break
        sleep(poll_s)
    failed = [state for state in states if state.failed]
    if failed:
        raise SystemExit(
            f"launch/tpu.py: the run ended with {len(failed)} failed role process(es): "
            + "; ".join(map(str, failed))
            + " (python launch/tpu.py logs shows their output)"
        )
    shell.note(f"every role process exited 0 ({len(states)}): the run is over")
    return states


def execute(
    action: str,
    pod: Pod,
    shell: Shell,
    *,
    config_path: str = "",
    overrides: Sequence[str] = (),
    coordinator_ip: str | None = None,
    lines: int = 50,
    node: str | None = None,
    worker: str = "0",
    command: str | None = None,
    archive: str | None = None,
    wait: bool = False,
    poll_s: float = 60.0,
    credentials_dir: str | None = None,
) -> None:
    """Runs (or prints) the commands of one action. `credentials_dir`: where `run` makes the run's
    credentials (kept; a test reads them); by default a private temporary directory, removed."""
    if action == "create":
        for argv in commands.create(pod):
            shell.run(argv)
    elif action == "setup":
        archive = archive or os.path.join("/tmp", f"dora_jax-{pod.name}.tar.gz")
        pack(REPO_ROOT, archive, shell)
        for argv in commands.setup(pod, archive):
            shell.run(argv)
    elif action == "run":
        host = "localhost"
        if pod.layout is not pod_lib.Layout.SINGLE_HOST:
            host = coordinator_ip or shell.capture(commands.coordinator_ip(pod), COORDINATOR_IP_DRY_RUN)
        if pod.layout is not pod_lib.Layout.SINGLE_HOST:  # the embedded run has no coordinator to reach
            _hand_out_credentials(pod, shell, credentials_dir)
        for argv in commands.run(pod, remote_config_path(config_path), overrides, host):
            shell.run(argv)
        shell.note(f"logs: python launch/tpu.py logs --config={config_path}; workdir: {pod.workdir}")
        if wait:
            wait_for_end(pod, shell, poll_s)
    elif action == "wait":
        wait_for_end(pod, shell, poll_s)
    elif action == "logs":
        for argv in commands.logs(pod, lines):
            shell.run(argv)
    elif action == "ssh":
        shell.run(commands.ssh(pod, pod.node(node) if node else pod.trainer, worker, command))
    elif action == "stop":
        for argv in commands.stop(pod):
            shell.run(argv)
    elif action == "status":
        for argv in commands.status(pod):
            shell.run(argv)
    elif action == "delete":
        for argv in commands.delete(pod):
            shell.run(argv)
    else:
        raise ValueError(f"action {action!r}; expected one of {ACTIONS}")


def _hand_out_credentials(pod: Pod, shell: Shell, directory: str | None) -> None:
    """A fresh run secret and role tokens (TLS material with pod.tls), copied each to its node."""
    from dora_jax.transport import auth

    private = directory or tempfile.mkdtemp(prefix="dora_run_auth_")
    try:
        made = auth.make_run_credentials(private, len(pod.rollout_nodes), tls=pod.tls)
        shell.note(f"made the run secret and {len(made.token_files)} role tokens (files of mode 600, not shown)")
        for argv in commands.credentials(pod, made):
            shell.run(argv)
    finally:
        if directory is None:
            shutil.rmtree(private, ignore_errors=True)


def check_placeholders(config, action: str, shell: Shell) -> None:
    """A real create/setup/run refuses `YOUR_...` values; a dry run only warns."""
    if action not in ("create", "setup", "run"):
        return
    fields = pod_lib.placeholders(config)
    if not fields:
        return
    message = f"these fields still hold a {pod_lib.PLACEHOLDER}... placeholder: {', '.join(fields)}"
    if not shell.dry_run:
        raise ValueError(message + "; set them in the config or with --config.FIELD=VALUE")
    shell.note("warning: " + message)


def config_overrides(argv: Sequence[str]) -> list[str]:
    """The `--config.X=Y` arguments, forwarded verbatim to every role on the pod."""
    return [a for a in argv if a.startswith("--config.")]


def _main(argv, flags_) -> None:
    if len(argv) != 2 or argv[1] not in ACTIONS:
        raise SystemExit(f"usage: python launch/tpu.py <{'|'.join(ACTIONS)}> --config=configs/X.py [--dry-run]")
    action = argv[1]
    config = flags_.config.value
    shell = Shell(dry_run=flags_.dry_run.value)
    try:
        pod = pod_lib.from_config(config, workdir=flags_.workdir.value or "")
        if flags_.check_run_config.value and action in ("create", "setup", "run"):
            from dora_jax.runtime import run_config  # validates everything the roles will read, before paying for TPUs

            run_config.parse(config)
        check_placeholders(config, action, shell)
    except ValueError as error:
        raise SystemExit(f"launch/tpu.py: config error: {error}") from None
    execute(
        action,
        pod,
        shell,
        config_path=flags_.config_path(),
        overrides=config_overrides(sys.argv),
        coordinator_ip=flags_.coordinator_ip.value,
        lines=flags_.lines.value,
        node=flags_.node.value,
        worker=flags_.worker.value,
        command=flags_.command.value,
        wait=flags_.wait.value,
        poll_s=flags_.poll_s.value,
    )


class _Flags:
    """absl flags, defined only when run as a program (importing this module defines none)."""

    def __init__(self):
        from absl import flags
        from ml_collections import config_flags

        self.config = config_flags.DEFINE_config_file(
            "config", None, "experiment config file (configs/*.py)", lock_config=True
        )
        self.workdir = flags.DEFINE_string("workdir", None, "run directory on the pod; default: pod.workdir")
        self.dry_run = flags.DEFINE_bool("dry_run", False, "print the commands instead of running them")
        self.check_run_config = flags.DEFINE_bool(
            "check_run_config", True, "validate with dora_jax.runtime.run_config.parse before create/setup/run"
        )
        self.coordinator_ip = flags.DEFINE_string(
            "coordinator_ip", None, "run: skip looking up the trainer's worker-0 IP"
        )
        self.lines = flags.DEFINE_integer("lines", 50, "logs: lines per log file")
        self.node = flags.DEFINE_string("node", None, "ssh: node name; default: the trainer (or single host)")
        self.worker = flags.DEFINE_string("worker", "0", "ssh: worker index or 'all'")
        self.command = flags.DEFINE_string("command", None, "ssh: a command instead of an interactive shell")
        self.wait = flags.DEFINE_bool("wait", True, "run: wait until every role exits and report (--nowait: return)")
        self.poll_s = flags.DEFINE_float("poll_s", 60.0, "run/wait: seconds between polls of the role processes")
        self._flags = flags

    def config_path(self) -> str:
        from ml_collections import config_flags

        return config_flags.get_config_filename(self._flags.FLAGS["config"])


if __name__ == "__main__":
    from absl import app

    _FLAGS = _Flags()
    sys.argv = [("--dry_run" if a == "--dry-run" else a) for a in sys.argv]
    app.run(lambda argv: _main(argv, _FLAGS))
