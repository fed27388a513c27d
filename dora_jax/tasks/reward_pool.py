"""Reward functions off the critical path: worker processes, a timeout per sample, no crash spreads.

`RewardPool(fn, num_workers, timeout_s)` runs `fn(*args)` in `num_workers` worker processes and
hands back a `concurrent.futures.Future` per sample whose result is always a `RewardResult`
(never an exception). A sample that fails gets `value=0.0` and `error="<why>"`, which the
coordinator uses to mask it out of the loss:
- the function raised (`"ValueError: ..."`),
- it returned something that is not a finite real number,
- it ran past `timeout_s` (the worker is killed and replaced; the pool keeps going),
- the worker process died (segfault, `os._exit`, OOM kill): replaced likewise.

Why our own pool rather than `ProcessPoolExecutor`: the executor cannot kill one hung worker,
and one dead worker breaks the whole executor (every pending future fails). Why `subprocess`
rather than `multiprocessing`'s spawn: spawn re-imports the parent's `__main__` in every worker,
which for `python -m dora_jax.train` means JAX and the whole trainer; a worker here imports only
this module and the reward function's own module (plus `preload`).

One dispatcher thread owns the workers: it hands one sample at a time to each idle worker, so it
always knows which sample a dead or late worker was scoring. Futures' callbacks run on it: keep
them short. `fn` must be a top-level function (pickled by reference).
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import importlib
import itertools
import math
import numbers
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

_MAX_STARTUP_FAILURES = 3  # consecutive workers that die before ready: the pool is broken
_ERROR_CHARS = 500


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """A sample's reward; `error` set means scoring failed and `value` is 0.0."""

    value: float
    error: str | None = None
    key: str = ""
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def check_value(value: Any) -> tuple[float, str | None]:
    """(value, None) for a finite real number, else (0.0, why)."""
    if not isinstance(value, numbers.Real):
        return 0.0, f"returned {type(value).__name__} {repr(value)[:80]}, not a number"
    value = float(value)
    if not math.isfinite(value):
        return 0.0, f"returned non-finite {value}"
    return value, None


def _call(fn: Callable[..., Any], args: tuple) -> tuple[float, str | None]:
    try:
        return check_value(fn(*args))
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # SystemExit from a reward function is its failure, not ours
        return 0.0, f"{type(err).__name__}: {err}"[:_ERROR_CHARS]


@dataclasses.dataclass
class _Task:
    task_id: int
    key: str
    payload: bytes  # pickled args
    future: concurrent.futures.Future


@dataclasses.dataclass
class _Worker:
    process: subprocess.Popen
    inbox: Connection  # parent -> worker
    outbox: Connection  # worker -> parent
    deadline: float  # startup deadline while starting, sample deadline while busy
    ready: bool = False
    task: _Task | None = None
    sent_t: float = 0.0


class RewardPool:
    """Scores samples with `fn(*args)` in worker processes, `timeout_s` per sample."""

    def __init__(
        self,
        fn: Callable[..., Any],
        num_workers: int = 2,
        timeout_s: float = 30.0,
        preload: Sequence[str] = (),
        startup_timeout_s: float = 60.0,
    ):
        if num_workers < 1:
            raise ValueError(f"RewardPool num_workers={num_workers}: must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool timeout_s={timeout_s}: must be > 0")
        try:
            self._init_payload = pickle.dumps((fn, tuple(preload)))
        except Exception as err:
            raise ValueError(
                f"reward function {fn!r} is not picklable by reference; use a top-level function: {err}"
            ) from None
        self.fn_name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.worker_restarts = 0  # workers replaced after a timeout or a crash
        self._lock = threading.Lock()
        self._pending: collections.deque[_Task] = collections.deque()
        self._ids = itertools.count()
        self._closing = False
        self._broken: str | None = None
        self._startup_failures = 0
        self._workers: list[_Worker] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------

    def submit(self, key: str, args: tuple) -> concurrent.futures.Future:
        """Schedules `fn(*args)`; the future's result is a `RewardResult` (never an exception)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            payload = pickle.dumps(tuple(args))
        except Exception as err:
            future.set_result(RewardResult(0.0, f"arguments not picklable: {err}"[:_ERROR_CHARS], key))
            return future
        with self._lock:
            if self._closing:
                raise RuntimeError("RewardPool is closed")
            if self._broken is not None:
                raise RuntimeError(f"RewardPool for {self.fn_name} is broken: {self._broken}")
            self._pending.append(_Task(next(self._ids), key, payload, future))
            self._wake()
        return future

    def score_many(self, items: Sequence[tuple], keys: Sequence[str] | None = None) -> list[RewardResult]:
        """Scores every args tuple in `items`; results in the same order."""
        keys = [str(i) for i in range(len(items))] if keys is None else list(keys)
        futures = [self.submit(key, args) for key, args in zip(keys, items, strict=True)]
        return [future.result() for future in futures]

    def close(self) -> None:
        """Stops the workers; samples not yet scored get error 'reward pool closed'."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._wake()
        self._thread.join()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- dispatcher thread ------------------------------------------------------------------

    def _wake(self) -> None:
        """Interrupts the dispatcher's wait. Call with the lock held (the fds close under it)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # a bug here: make it visible to submit() as well
            with self._lock:
                self._broken = f"dispatcher thread failed: {type(err).__name__}: {err}"
            raise
        finally:
            self._shutdown()

    def _loop(self) -> None:
        while not self._closing:
            self._start_workers()
            self._assign()
            deadlines = [w.deadline for w in self._workers if w.task is not None or not w.ready]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            ready = wait([self._wake_r, *(w.outbox for w in self._workers)], timeout)
            for item in ready:
                if item == self._wake_r:
                    self._drain_wake()
                else:
                    self._receive(next(w for w in self._workers if w.outbox is item))
            self._expire(time.monotonic())

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _start_workers(self) -> None:
        while self._broken is None and len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        task_r, task_w = os.pipe()
        result_r, result_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env["DORA_REWARD_PARENT_PID"] = str(os.getpid())
        process = subprocess.Popen(
            [sys.executable, "-m", "dora_jax.tasks.reward_pool", str(task_r), str(result_w)],
            pass_fds=(task_r, result_w),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        os.close(task_r)
        os.close(result_w)
        worker = _Worker(
            process,
            Connection(task_w, readable=False),
            Connection(result_r, writable=False),
            deadline=time.monotonic() + self.startup_timeout_s,
        )
        try:
            worker.inbox.send_bytes(self._init_payload)
        except OSError:
            pass  # it died at once: its outbox reads EOF and _receive reports it
        return worker

    def _assign(self) -> None:
        for worker in self._workers:
            if not worker.ready or worker.task is not None:
                continue
            task = self._pop_pending()
            if task is None:
                return
            worker.task, worker.sent_t = task, time.monotonic()
            worker.deadline = worker.sent_t + self.timeout_s
            try:
                worker.inbox.send((task.task_id, task.payload))
            except OSError:
                pass  # dead worker: its outbox reads EOF and _receive fails the task

    def _pop_pending(self) -> _Task | None:
        with self._lock:
            while self._pending:
                task = self._pending.popleft()
                if task.future.set_running_or_notify_cancel():
                    return task
        return None

    def _receive(self, worker: _Worker) -> None:
        try:
            message = worker.outbox.recv()
        except (EOFError, OSError):
            self._replace(worker, f"reward worker died ({_exit_status(worker.process)})")
            return
        if message[0] == "ready":
            worker.ready, self._startup_failures = True, 0
        elif message[0] == "startup_error":
            self._replace(worker, f"reward worker failed to start: {message[1]}")
        else:
            task_id, value, error = message
            task = worker.task
            assert task is not None and task.task_id == task_id, (task_id, task)
            worker.task = None
            task.future.set_result(RewardResult(value, error, task.key, time.monotonic() - worker.sent_t))

    def _expire(self, now: float) -> None:
        for worker in list(self._workers):
            if worker.task is not None and now >= worker.deadline:
                self._replace(worker, f"timeout after {self.timeout_s:g}s")
            elif not worker.ready and now >= worker.deadline:
                self._replace(worker, f"reward worker not ready after {self.startup_timeout_s:g}s")

    def _replace(self, worker: _Worker, reason: str) -> None:
        """Kills `worker`, fails its sample with `reason`; a fresh one starts on the next loop."""
        _kill(worker)
        self._workers.remove(worker)
        if worker.task is not None:
            task, worker.task = worker.task, None
            task.future.set_result(RewardResult(0.0, reason, task.key, time.monotonic() - worker.sent_t))
        if worker.ready:
            self.worker_restarts += 1
            return
        self._startup_failures += 1
        if self._startup_failures >= _MAX_STARTUP_FAILURES:
            with self._lock:
                self._broken = f"{self._startup_failures} workers in a row failed to start; last: {reason}"
            self._fail_pending(self._broken)

    def _fail_pending(self, reason: str) -> None:
        while (task := self._pop_pending()) is not None:
            task.future.set_result(RewardResult(0.0, reason, task.key))

    def _shutdown(self) -> None:
        with self._lock:
            self._closing = True
        for worker in self._workers:
            if worker.task is not None:  # mid-sample: its result would be thrown away
                worker.task.future.set_result(RewardResult(0.0, "reward pool closed", worker.task.key))
                worker.process.kill()
                continue
            try:
                worker.inbox.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for worker in self._workers:
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill(worker)
        self._workers = []
        self._fail_pending("reward pool closed")
        with self._lock:
            os.close(self._wake_r)
            os.close(self._wake_w)


def _kill(worker: _Worker) -> None:
    if worker.process.poll() is None:
        worker.process.kill()
    worker.process.wait()
    worker.inbox.close()
    worker.outbox.close()


def _exit_status(process: subprocess.Popen) -> str:
    try:
        code = process.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return "closed its pipe but is still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class InlineRewardPool:
    """The same API in the caller's thread: no processes, no timeout. For tests and fakes."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def submit(self, key: str, args: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        start = time.monotonic()
        value, error = _call(self.fn, tuple(args))
        future.set_result(RewardResult(value, error, key, time.monotonic() - start))
        return future

    def score_many(self, items: Sequence[tuple], keys: Sequence[str] | None = None) -> list[RewardResult]:
        keys = [str(i) for i in range(len(items))] if keys is None else list(keys)
        return [self.submit(key, args).result() for key, args in zip(keys, items, strict=True)]

    def close(self) -> None:
        pass


def _tie_to_parent(parent_pid: int) -> None:
    """Ctrl-C goes to the parent (which closes the pool); on Linux, the worker is SIGKILLed when
    its parent dies, so a worker hung in C code cannot outlive the run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _worker_main(task_fd: int, result_fd: int) -> int:
    """A worker: load the function, then score one sample at a time until EOF or None."""
    _tie_to_parent(int(os.environ.get("DORA_REWARD_PARENT_PID", os.getppid())))
    inbox, outbox = Connection(task_fd, writable=False), Connection(result_fd, readable=False)
    try:
        fn, preload = pickle.loads(inbox.recv_bytes())
        for module in preload:
            importlib.import_module(module)
    except EOFError:
        return 0
    except Exception as err:
        outbox.send(("startup_error", f"{type(err).__name__}: {err}"[:_ERROR_CHARS]))
        return 1
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            message = inbox.recv()
        except EOFError:  # the parent is gone
            return 0
        if message is None:
            return 0
        task_id, payload = message
        try:
            args = pickle.loads(payload)
        except Exception as err:
            outbox.send((task_id, 0.0, f"cannot unpickle arguments: {err}"[:_ERROR_CHARS]))
            continue
        outbox.send((task_id, *_call(fn, args)))


if __name__ == "__main__":
    sys.exit(_worker_main(int(sys.argv[1]), int(sys.argv[2])))
