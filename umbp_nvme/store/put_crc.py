"""Where a put batch's CRC32C runs, so that it never delays a get's completion handling.

A get completes on the store's loop thread; on a small machine it also waits for a free core.
So while reads are about (the arbiter says: a read batch in flight or one ended within
``READ_QUIET_S``) a put's CRC runs on a thread of its own at low CPU priority: the loop
thread, the callers and the kernel's completions take a core first, and the CRC (which runs
beside its own write and costs no wall time unless it outlasts it) gets what is left. With no
reads about, the cheaper paths stay: a small batch on the loop thread (a hop to a thread and back
costs ~200 us of CPU), a large one on the default executor at normal priority.

Jobs go to long-lived worker threads, one per policy while jobs come one at a time (up to
``CRC_WORKERS_MAX`` when they overlap), each ending after ``IDLE_EXIT_S`` without a job (so a
closed store leaves no thread behind for long). A thread per job cost the loop 2-4 ms
per put batch on a busy 2-core machine: ``Thread.start`` waits until the new thread has run, and
that stall sat in front of every get arriving meanwhile (docs/benchmarks.md, "the loop's stalls").
The store's config says whether the worker is used (``ssd_crc_worker``) and how it lowers its
priority (``ssd_crc_policy``, chosen by measurement, docs/benchmarks.md): ``idle`` = SCHED_IDLE,
``batch`` = SCHED_BATCH at nice ``ssd_crc_nice``, ``nice`` = nice ``ssd_crc_nice``, ``normal`` = no
change (a control for benchmarks). The threads are shared by every store of the process, one pool
per (policy, nice). A thread id's policy is its own on Linux (``sched_setscheduler(0, ...)`` /
``setpriority(PRIO_PROCESS, tid, ...)`` from the thread).

Reads: state.arbiter (reads in flight) and the config's CRC worker settings, handed in. Changes: no
store state (the process's worker pools, shared by every store).
"""

from __future__ import annotations

import _thread
import asyncio
import logging
import os
import queue
import threading

from ..config import CRC_POLICIES

log = logging.getLogger("umbp_nvme.store")

IDLE_EXIT_S = 2.0  # a worker with no job for this long ends
CRC_WORKERS_MAX = min(8, os.cpu_count() or 1)  # worker threads per policy at most


def lower_priority(policy: str, nice: int) -> str:
    """Lower the calling thread's CPU priority as ``policy`` says; returns what was applied
    ("normal" where the kernel refused: the CRC still runs, only without the lower priority)."""
    if policy not in CRC_POLICIES:
        raise ValueError(f"CRC policy must be one of {CRC_POLICIES}, got {policy!r}")
    try:
        if policy == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif policy == "batch":
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        elif policy == "nice":
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as e:  # not Linux, or a seccomp profile that refuses it
        if not Counts.warned:
            Counts.warned = True
            log.warning("CRC worker: could not apply CPU policy %s (%s); it runs at normal priority", policy, e)
        return "normal"
    return policy


def thread_policy(tid: int) -> tuple[int, int]:
    """(scheduling policy, nice) of a thread of this process, for tests and the bench's notes."""
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


class Counts:
    jobs = 0  # jobs started (tests, bench notes)
    applied: str | None = None  # the policy the last job ran under
    warned = False


class _Workers:
    """Threads at one CPU policy taking jobs from one queue: a new one is started (without waiting
    for it to run) when a job would otherwise wait, up to CRC_WORKERS_MAX (several drives' puts in
    one process checksum side by side); each ends after IDLE_EXIT_S without a job."""

    def __init__(self, policy: str, nice: int):
        self.policy, self.nice = policy, nice
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads = 0
        self.idle = 0  # threads not running a job

    def submit(self, job) -> None:
        with self.lock:
            if not self.threads or (self.jobs.qsize() >= self.idle and self.threads < CRC_WORKERS_MAX):
                try:
                    _thread.start_new_thread(self._run, ())  # unlike Thread.start, never waits for it
                except RuntimeError:
                    if not self.threads:  # nobody would take the job: the put fails instead
                        raise
                else:
                    self.threads += 1
                    self.idle += 1
            self.jobs.put(job)

    def _run(self) -> None:
        try:
            applied = lower_priority(self.policy, self.nice)
        except Exception:  # noqa: BLE001 - an unknown policy: run the queued jobs anyway, never strand them
            log.exception("CRC worker: policy %r not applied; it runs at normal priority", self.policy)
            applied = "normal"
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self.lock:  # a job submitted meanwhile finds this thread still counted
                    if self.jobs.empty():
                        self.threads -= 1
                        self.idle -= 1
                        return
                continue
            with self.lock:
                self.idle -= 1
            Counts.applied = applied
            loop, fut, fn, args = job
            try:
                res, exc = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting put
                res, exc = None, e
            with self.lock:  # idle again before the put hears of it: its next job needs no new thread
                self.idle += 1
            try:
                loop.call_soon_threadsafe(_resolve, fut, res, exc)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass


_workers: dict[tuple[str, int], _Workers] = {}  # (policy, nice) -> its threads
_workers_lock = threading.Lock()


def _forget_workers() -> None:
    """In a forked child: the parent's workers are not running here (fork copies one thread)."""
    global _workers_lock
    _workers.clear()
    _workers_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


def run_low(fn, *args, policy: str, nice: int) -> asyncio.Future:
    """``fn(*args)`` on a worker at CPU ``policy`` (and ``nice``); the future is resolved on the
    caller's loop once ``fn`` has returned (so once it no longer reads the caller's memory)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    Counts.jobs += 1
    key = (policy, nice)
    with _workers_lock:
        worker = _workers.get(key) or _workers.setdefault(key, _Workers(policy, nice))
    worker.submit((loop, fut, fn, args))
    return fut


def _resolve(fut: asyncio.Future, res, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)


def dispatch(arbiter, crc_many, src, nbytes, out, inline_max: int, config):
    """Start a put batch's CRCs (``crc_many(src, nbytes, out)``) where they cannot hold up a get.

    Returns the job's future, or None when the caller runs them on the loop thread (no reads
    about and at most ``inline_max`` bytes). ``arbiter``: the store's (None when slicing is off:
    then, as with ``ssd_read_priority=off``, reads are not tracked and today's split stays).
    ``config``: the store's StoreConfig (its ``ssd_crc_*`` settings)."""
    if config.ssd_crc_worker and arbiter is not None and arbiter.reads_about():
        return run_low(crc_many, src, nbytes, out, policy=config.ssd_crc_policy, nice=config.ssd_crc_nice)
    if int(nbytes.sum()) > inline_max:
        return asyncio.get_running_loop().run_in_executor(None, crc_many, src, nbytes, out)
    return None
