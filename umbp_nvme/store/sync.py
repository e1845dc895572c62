"""SyncPageStore: a PageStore on a private event-loop thread, callable from any thread.

SGLang calls storage synchronously from several controller threads; none of them has (or may
rely on) a running loop. Every call here is one ``run_coroutine_threadsafe`` hop. A data call
that runs past a few ``io_timeout_s`` is cancelled and reports all-False, but only once the store
call has really ended: until then the kernel may still read or write the caller's memory (the
store waits for its completions; the block layer's own timeout bounds that). The exists calls
skip the hop: they read the index directly (see ``PageStore.exists_*_nowait``). So does
``drive_rows``: over several drives, the loop thread keeps a snapshot of the per-drive stats rows
(taken at the end of every call made here, and every ``ROWS_REFRESH_S``), which any thread reads
without a lock: SGLang's scheduler thread reads it on every pass.

Reads: its PageStore through its public calls. Changes: its own loop thread only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

from ..config import StoreConfig
from .drives import MultiDriveStore
from .page_store import PageStore

log = logging.getLogger("umbp_nvme.sync_store")  # the name operators know; kept across the move

CALL_SLACK_S = 5.0  # a call may wait on a few io_timeout_s-bounded steps (evict, write, sync, commit)
ROWS_REFRESH_S = 0.25  # drive_rows shows changes made outside our calls (probes, stall timers) within this long
COUNT_REFRESH_S = 1.0  # a reader's per-drive object counts (drive_rows) are at most about this old


async def _on_loop(fn):
    return fn()


class ReadOnlyRow(dict):
    """A drive's stats row in the snapshot ``drive_rows`` hands out: a dict (JSON, ``==``, reads)
    that refuses changes, so every caller can be handed the same one without a copy."""

    def _refuse(self, *a, **kw):
        raise TypeError("a drive row is a read-only snapshot shared by every caller; copy it first: dict(row)")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):  # pickles (and deep-copies) as the plain dict it holds
        return (dict, (dict(self),))


class SyncPageStore:
    """The serving facade (the SGLang backend opens its stores through it).

    Capacity: the config's ``ssd_capacity_bytes`` is the server's deliberate setting, so by
    default (``shrink=True``) a writer opened with less than the store records shrinks it,
    evicting the objects in the removed segments durably and logging it. Pass ``shrink=False`` to
    be refused instead, or ``capacity_from_manifest=True`` to run with the recorded capacity.
    """

    def __init__(
        self,
        path,
        config: StoreConfig | None = None,
        *,
        readonly: bool = False,
        namespace: dict | None = None,
        capacity_from_manifest: bool = False,
        shrink: bool = True,
        engine_factory=None,
        hooks=None,
        page_of=None,
        call_slack_s: float = CALL_SLACK_S,
    ):
        """``path``: one root, or several (a list / JSON list / comma-separated string; see
        drives.MultiDriveStore, which ``page_of(key) -> page hash`` places by). A call is given up
        on after ``4 * io_timeout_s + call_slack_s`` (tests shorten the slack)."""
        config = config or StoreConfig()
        self._timeout_s = float(config.io_timeout_s) * 4 + float(call_slack_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="umbp-store-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self._closed_logged = False
        self._rows: tuple = ()  # drive_rows' snapshot: replaced whole on the loop thread, read anywhere
        self._counts_due = 0.0  # when a reader's object counts are next refreshed (loop thread)
        self.metrics = None  # a metrics.StoreWatch while exported: times each batch call
        try:
            self.store: PageStore | MultiDriveStore = self._call(
                PageStore.open(
                    path, config, readonly=readonly, namespace=namespace, page_of=page_of,
                    capacity_from_manifest=capacity_from_manifest, shrink=shrink, engine_factory=engine_factory,
                    hooks=hooks,
                )  # fmt: skip
            )
            if isinstance(self.store, MultiDriveStore):
                self._call(_on_loop(self._rows_tick))  # the first snapshot, then one every ROWS_REFRESH_S
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def open(cls, path, config: StoreConfig | None = None, **kw) -> "SyncPageStore":
        """Same as ``SyncPageStore(path, config, **kw)``: opens the store on a private loop thread.

        Keywords as ``PageStore.open`` (``readonly``, ``namespace``, ``capacity_from_manifest``,
        ``shrink`` - True by default here - ``engine_factory``, ``hooks``) plus ``page_of`` for several
        roots and ``call_slack_s``.
        Raises what ``PageStore.open`` raises.
        """
        return cls(path, config, **kw)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _rows_now(self) -> None:
        """On the loop thread: a new drive_rows snapshot (several drives only). Never raises: it
        ends every call."""
        store = getattr(self, "store", None)
        if isinstance(store, MultiDriveStore):
            try:
                self._rows = tuple(map(ReadOnlyRow, store.drive_rows_nowait()))
            except Exception as e:  # noqa: BLE001 - the rows stay as they were; the call's answer stands
                log.debug("%s: drive rows not refreshed: %r", store.path, e)

    def _rows_tick(self) -> None:
        """On the loop thread, every ROWS_REFRESH_S while open: the snapshot follows what changes
        outside our calls (probes, stall timers), and a reader counts its objects again."""
        if self._closed:
            return
        now = time.monotonic()
        if self.store.readonly and now >= self._counts_due:
            self._counts_due = now + COUNT_REFRESH_S
            self.store.refresh_object_counts()
        self._rows_now()
        self._loop.call_later(ROWS_REFRESH_S, self._rows_tick)

    async def _then_rows(self, coro):
        try:
            return await coro
        finally:
            self._rows_now()  # before the caller gets the answer: its call's effects are in the rows

    def _call(self, coro, timeout: float | None = None):
        fut = asyncio.run_coroutine_threadsafe(self._then_rows(coro), self._loop)
        try:
            return fut.result(timeout if timeout is not None else self._timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def _closed_call(self, what: str) -> bool:
        if self._closed:
            if not self._closed_logged:
                self._closed_logged = True
                log.warning("%s on a closed store; every call now answers False / 0 (logged once)", what)
            return True
        return False

    def _bounded(self, coro, n: int, what: str) -> list[bool]:
        if self._closed_call(what):
            coro.close()
            return [False] * n
        ended = threading.Event()
        started = []

        async def run():
            started.append(True)
            try:
                return await coro
            finally:
                self._rows_now()  # before the caller gets the answer: its call's effects are in the rows
                ended.set()

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return fut.result(self._timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            log.error(
                "%s of %d keys did not finish within %.1f s; cancelled, waiting for the kernel to give back "
                "the memory, then reporting misses", what, n, self._timeout_s,
            )  # fmt: skip
            # The store call ends only once no I/O into the caller's buffers is in flight. A call
            # the loop never started (it was blocked all along) never will: the loop runs the
            # cancel before this sentinel.
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._loop).result()
            if started:
                ended.wait()
            else:
                coro.close()
            return [False] * n

    # --- data path ---

    def put_many(self, keys, buffers, *, depths=None) -> list[bool]:
        """``PageStore.put_many``, blocking: one bool per key, True once published.

        A call that outlives ``4 x io_timeout_s`` (+5 s) answers all False once the kernel has let go
        of the buffers. Raises ReadOnlyStoreError on a read-only store and ValueError for mismatched
        lengths; a closed store answers all False.
        """
        t0 = time.perf_counter()
        r = self._bounded(self.store.put_many(keys, buffers, depths=depths), len(keys), "put_many")
        if self.metrics is not None:
            self.metrics.observe("put", t0, len(keys))
        return r

    def get_many(self, keys, buffers) -> list[bool]:
        """``PageStore.get_many``, blocking: one bool per key, True when the buffer holds the verified
        object; False for a miss or a failure of that key (a call past its bound: all False, after the
        kernel has let go of the buffers). Raises ValueError for mismatched lengths.
        """
        t0 = time.perf_counter()
        r = self._bounded(self.store.get_many(keys, buffers), len(keys), "get_many")
        if self.metrics is not None:
            self.metrics.observe("get", t0, len(keys))
        return r

    def delete_many(self, keys) -> list[bool]:
        """``PageStore.delete_many``, blocking: True per key once its removal is durable; False when it
        was absent or the removal failed. Raises ReadOnlyStoreError on a read-only store."""
        return self._bounded(self.store.delete_many(keys), len(keys), "delete_many")

    def exists_many(self, keys) -> list[bool]:
        """Per key, whether it is stored (no loop hop: reads the index from the calling thread).
        A key that cannot be stored, or a closed store, answers False; never raises for a key."""
        if self._closed_call("exists_many"):
            return [False] * len(keys)
        t0 = time.perf_counter()
        r = self.store.exists_many_nowait(keys)
        if self.metrics is not None:
            self.metrics.observe("exists", t0, len(keys))
        return r

    def exists_prefix(self, keys) -> int:
        """How many leading ``keys`` are stored (no loop hop). 0 on a closed store."""
        if self._closed_call("exists_prefix"):
            return 0
        t0 = time.perf_counter()
        r = self.store.exists_prefix_nowait(keys)
        if self.metrics is not None:
            self.metrics.observe("exists", t0, len(keys))
        return r

    exists_many_nowait = exists_many
    exists_prefix_nowait = exists_prefix

    # --- management ---

    def register_memory(self, address: int, nbytes: int) -> bool:
        """Allow ``(address, nbytes)`` pairs inside this range as buffers (SGLang's host pool).

        True when an engine also took it as fixed buffers (faster); False when it did not, or when
        the range is not mapped readable and writable here (then buffers inside it are refused, one
        ERROR line), or the store is closed.
        """
        if self._closed_call("register_memory"):
            return False

        async def reg():
            return self.store.register_memory(address, nbytes)

        return self._call(reg())

    def stats(self, timeout_s: float | None = None) -> dict:
        """``PageStore.stats()`` read on the store's loop (``timeout_s`` bounds the wait; a closed
        store answers its last counters)."""
        if self._closed:  # the loop is stopped; the closed store's counters are plain reads
            return self.store.stats()

        async def st():
            return self.store.stats()

        return self._call(st(), timeout_s)

    def drive_rows(self) -> list[dict]:
        """``stats()["drives"]`` without the loop hop, for callers that must never wait (SGLang's
        scheduler thread, docs/sglang.md §2): a new list of the loop's snapshot rows (read-only
        dicts, ``ReadOnlyRow``: shared, never copied), which include every call made through this
        object that has returned and are at most ``ROWS_REFRESH_S`` behind anything else (a
        reader's object counts ``COUNT_REFRESH_S``). [] for a single drive. While the loop is
        blocked it answers at once, with the rows as they were."""
        return list(self._rows)

    def flush(self) -> bool:
        """fdatasync segments and index; True when all of it is durable. False on a closed store,
        an I/O error or a timeout; never raises for those."""
        if self._closed_call("flush"):
            return False
        try:
            return self._call(self.store.flush())
        except concurrent.futures.TimeoutError:
            return False

    def clear(self) -> None:
        """Drop every entry durably. Raises ReadOnlyStoreError on a read-only store and OSError when
        the records could not be cleared (nothing is dropped then). Does nothing on a closed store."""
        if self._closed_call("clear"):
            return
        self._call(self.store.clear())

    @property
    def loop(self):
        """The event loop the store runs on (its own thread): for probes that time it (bench mixed)."""
        return self._loop

    @property
    def readonly(self) -> bool:
        """True for a follower opened read-only."""
        return self.store.readonly

    @property
    def path(self) -> str:
        """The store directory (several roots: their absolute paths joined by commas)."""
        return self.store.path

    def close(self) -> None:
        """Close the store (waits for calls in flight, makes everything durable) and stop its loop
        thread. Idempotent; later calls answer False / 0."""
        if self._closed:
            return
        self._closed = True
        try:
            fut = asyncio.run_coroutine_threadsafe(self.store.close(), self._loop)
            try:
                fut.result(self._timeout_s)
            except concurrent.futures.TimeoutError:
                # store.close() waits for calls whose I/O the kernel still holds; stopping the
                # loop under them would strand their callers (and the kernel may still write
                # their memory), so the close waits too
                log.error("closing %s waits for I/O the kernel still holds", self.store.path)
                fut.result()
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self._timeout_s)
        if not self._thread.is_alive():
            try:
                self._loop.close()
            except RuntimeError as e:  # never fail a close over the loop's own bookkeeping
                log.warning("event loop of %s not closed: %s", getattr(self, "store", None) and self.store.path, e)

    def __enter__(self):
        """``with SyncPageStore(path, cfg) as store:`` closes the store on exit."""
        return self

    def __exit__(self, *exc):
        self.close()
