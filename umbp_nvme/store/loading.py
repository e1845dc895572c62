"""Serving before the index is loaded: a writer's open returns at once and loads behind it.

A large store's index takes seconds to load (page walk, allocator, key table: ~0.5 s per 1 M
objects). A writer whose index file holds at least ``ssd_background_open_bytes`` returns from
open with its engines and files ready and loads on a worker thread, running the same steps as
a synchronous open (opening.py: index check or rebuild, rows, allocator, record areas); the
clock is joined on the loop thread when they are done. Until then:

- lookups (exists, get, locate, keys) answer misses: nothing is served that was not loaded and
  checked, so never a wrong byte and never a page replaced or deleted since;
- a put waits for the load up to ``PUT_WAIT_S`` and then answers False (counted in
  ``puts_refused_loading``): it never allocates a slot the load has not seen;
- a delete, clear or flush waits for the load to finish: a delete of a key not loaded yet must
  still remove it, and one acknowledged must be durable (records and index), as always;
- close() asks the load to stop at its next step and waits for it; a load stopped before it
  read the rows leaves the index as it found it.

A load that fails (what a synchronous open would have raised) leaves the store answering
misses and refusing writes, logged once; ``stats()["loading"]`` says "failed: ..." then.
Single-root stores only: the drives of a multi-drive store share one clock and open together.

A read-only opener (a follower) whose index file is that large likewise returns at once with a
stand-in watch that answers misses (follower.LoadingWatch) while a worker thread checks the file
(the page walk that keeps LMDB from crashing on damage) and opens it; then its lookups follow the
writer's file as always (follower.IndexWatch).

Reads: state.loading, state.load_failed, state.load_stop. Changes: those (and, on the worker
thread, every field a synchronous open fills in, before the loop thread clears ``loading``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from .follower import IndexWatch, LoadingWatch
from .index import INDEX_FILE, Index
from .index_check import used_bytes

log = logging.getLogger("umbp_nvme.store")

PUT_WAIT_S = 1.0  # a put during the load waits this long for it, then answers False


class LoadStopped(Exception):
    """close() asked the background load to stop."""


class BackgroundLoad:
    """PageStore's background load (a mixin): start, finish, and the gates the calls ask."""

    def _background_index(self, o) -> bool:
        """Whether this open loads its index after returning: a large index file (a writer: one
        root, an existing store; the synchronous path handles a missing file)."""
        limit = int(self.config.ssd_background_open_bytes)
        if self.writer is not None and (o.clock_given is not None or o.manifest_created):
            return False
        try:
            size = used_bytes(os.path.join(self.path, INDEX_FILE))  # not its size: a writemap file spans its map
        except OSError:
            return False
        return size >= limit

    def _reader_standin(self, o) -> None:
        """A read-only opener's index until the worker opened it: a watch that answers misses."""
        from . import layout

        o.reader_load = (os.path.join(self.path, INDEX_FILE), layout.map_size_bytes(self.capacity_bytes))
        self.state.watch = LoadingWatch()

    def _start_load(self, o) -> None:
        """Run the index steps of the open on a worker thread; the loop thread installs the result."""
        st = self.state
        loop = asyncio.get_running_loop()
        st.loading = loop.create_future()
        t0 = time.perf_counter()
        steps = self._reader_steps if self.writer is None else self._load_steps
        work = loop.run_in_executor(None, steps, o)

        def done(f: asyncio.Future) -> None:
            err = f.exception() if not f.cancelled() else LoadStopped()
            if err is None:
                try:
                    self._finish_load(o, f.result())
                except Exception as e:  # noqa: BLE001 - misses and refused writes, never a wrong answer
                    err = e
            if isinstance(err, LoadStopped):
                st.load_failed = "stopped by close()"  # nothing loaded: close() skips the flush
            elif err is not None:
                st.load_failed = f"{type(err).__name__}: {err}"
                log.error("%s: loading the index in the background failed (%s); the store answers misses%s: fix the "
                          "cause and reopen it", self.path, st.load_failed,
                          "" if self.writer is None else " and refuses writes")  # fmt: skip
            fut, st.loading = st.loading, None
            if err is None:
                log.info("%s: index loaded in the background (%d objects, %.3f s)", self.path, self.object_count(),
                         time.perf_counter() - t0)  # fmt: skip
            fut.set_result(err is None)

        work.add_done_callback(done)
        log.info("opened store %s (%s, %s, engine %s, %.3f s): loading its index in the background", self.path,
                 "read-only" if self.writer is None else "writer", "strict" if st.strict else "relaxed",
                 st.read_engine.capabilities.name, st.open_seconds)  # fmt: skip

    def _load_steps(self, o) -> None:
        """A writer's worker thread: what a synchronous open does between the manifest and the engines."""
        self._load_step("index")
        self._open_index(o)
        if self.state.load_stop:
            ix = self.state.index
            if ix is not None and o.prior_state == b"clean":
                ix.set_writer_state(b"clean")  # nothing was changed: the next open trusts it as before
            raise LoadStopped()
        self._load_step("rows")
        self._load_writer_state(o)

    def _reader_steps(self, o):
        """A read-only opener's worker thread: the index file checked (its page walk) and opened."""
        ipath, map_size = o.reader_load
        self._load_step("index")
        return Index(ipath, readonly=True, map_size=map_size, durable=False)

    def _load_step(self, name: str) -> None:
        hook = self.state.hooks.load_step
        if hook is not None:
            hook(name)

    def _finish_load(self, o, got) -> None:
        """On the loop thread, once the worker is done: the clock (a writer), the index (a reader)."""
        st = self.state
        if self.writer is not None:
            self._start_clock(o.gen_max, o)  # loaded, even if close() asked it to stop: close() closes it cleanly
            return
        if st.closed or st.load_stop:
            got.close()
            raise LoadStopped()
        standin = st.watch
        st.index = got
        st.watch = IndexWatch(st, o.reader_load[1])  # lookups follow the writer's file from here on
        standin.close()

    def _loading(self) -> bool:
        """True while a writer's lookups must miss and its writes wait (loading, or the load failed)."""
        st = self.state
        return st.loading is not None or st.load_failed is not None

    def _loading_misses(self, n: int) -> None:
        self.state.counters["loading_misses"] += n

    async def wait_loaded(self) -> bool:
        """Wait for a background load; True when the store serves everything it holds (at once when
        it was loaded at open), False when the load failed or the store closed meanwhile."""
        st = self.state
        if st.loading is not None:
            await asyncio.shield(st.loading)
        return st.load_failed is None and not st.closed

    async def _loaded_for_write(self, bound_s: float | None) -> bool:
        """Wait (up to ``bound_s``, None: until done) for the load before a write; whether it may go on."""
        st = self.state
        if st.loading is not None:
            try:
                await asyncio.wait_for(asyncio.shield(st.loading), bound_s)
            except asyncio.TimeoutError:
                return False
        return st.load_failed is None and not st.closed

    async def _stop_load(self) -> None:
        """close(): stop the load at its next step and wait for it."""
        st = self.state
        if st.loading is None:
            return
        st.load_stop = True
        await asyncio.shield(st.loading)

    def loading_state(self) -> str | bool:
        """stats()["loading"]: False when loaded, True while loading, "failed: ..." after a failed load."""
        st = self.state
        if st.load_failed is not None:
            return f"failed: {st.load_failed}"
        return st.loading is not None
