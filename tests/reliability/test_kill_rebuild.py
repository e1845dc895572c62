"""SIGKILL mid-batch, then the index is lost: the segments' records bring back every
acknowledged object, byte-exact, and no acknowledged delete comes back (issue 14)."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import ROOT, payload, small_config
from umbp_nvme.store import PageStore
from umbp_nvme.store.index import INDEX_FILE

_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, sys.argv[3])
    from conftest import payload, small_config
    from umbp_nvme.store import PageStore

    async def main(path, rnd):
        st = await PageStore.open(path, small_config(ssd_durability_mode=sys.argv[4], ssd_capacity_bytes=128 << 20))
        for b in range(200):  # at most 25 MiB a round: nothing is evicted
            keys = [f"r{rnd}-b{b}-{i}" for i in range(32)]
            sizes = [3000 + 97 * (i % 5) for i in range(32)]
            ok = await st.put_many(keys, [payload(k, n) for k, n in zip(keys, sizes)])
            print("put", *[f"{k}:{n}" for k, n, g in zip(keys, sizes, ok) if g], flush=True)
            if b % 3 == 2:
                gone = keys[:4]
                print("deleting", *gone, flush=True)
                ok = await st.delete_many(gone)
                print("del", *[k for k, g in zip(gone, ok) if g], flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def _read_until_kill(p: subprocess.Popen, after_batches: int, delay_s: float) -> str:
    """The child's whole stdout: lines until ``after_batches`` acknowledged puts, then ``delay_s``
    more, then SIGKILL and the rest. The rest is read through the same file object: readline
    leaves whatever else the pipe held in that object's buffer, and communicate(timeout=...)
    reads the raw fd and never sees it (acknowledged deletes went missing that way)."""
    lines = []
    deadline = time.monotonic() + 120
    try:
        while sum(1 for x in lines if x.startswith("put")) < after_batches and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
        time.sleep(delay_s)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)  # dead: the pipe's write end is closed, so the read below ends
    return "".join(lines) + p.stdout.read()


def _parse(text: str) -> tuple[dict, set, set]:
    """(acknowledged key -> size, acknowledged deletes, keys of the delete the kill cut short)."""
    acked, deleted, doubt = {}, set(), set()
    for line in text.split("\n")[:-1]:  # the last piece was cut by the kill (or is empty)
        if not line.strip():  # a line the kill's partial flush left empty
            continue
        kind, *items = line.split()
        if kind == "put":
            for it in items:
                k, n = it.rsplit(":", 1)
                acked[k] = int(n)
        elif kind == "deleting":
            doubt = set(items)
        elif kind == "del":
            deleted.update(items)
            doubt = set()
    return acked, deleted, doubt


def _run_and_kill(path: str, rnd: int, mode: str, after_batches: int, delay_s: float) -> tuple[dict, set, set]:
    """Run the child until it acknowledged ``after_batches`` batches, let it go on ``delay_s``
    (mid-batch, most likely), SIGKILL it; (acknowledged key -> size, acknowledged deletes, keys of
    the delete the kill cut short: each may be gone or intact, never wrong)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-c", _CHILD, path, str(rnd), os.path.join(ROOT, "tests"), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    with p.stdout:
        return _parse(_read_until_kill(p, after_batches, delay_s))


def test_kill_reader_keeps_lines_the_pipe_already_held():
    """The child writes its ack lines before the parent reads the first: every line written before
    the kill is parsed, the acknowledged delete included (the old communicate(timeout=...) remainder
    dropped the lines readline had buffered, and an acknowledged delete looked like a lost object)."""
    out = "put a:1\ndeleting a\ndel a\nput b:2 c:3\ndeleting b\nput cut:4"
    child = f"import os, time\nos.write(1, {out!r}.encode())\ntime.sleep(60)"  # one write: one pipe read
    p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    with p.stdout:
        assert select.select([p.stdout], [], [], 60)[0], "the child wrote nothing"
        text = _read_until_kill(p, 1, 0.0)
    assert text == out
    assert _parse(text) == ({"a": 1, "b": 2, "c": 3}, {"a"}, {"b"})


@pytest.mark.parametrize("mode", ["strict", "relaxed"])
async def test_sigkill_mid_batch_then_index_lost_loses_no_acknowledged_object(tmp_path, mode):
    path = str(tmp_path / "store")
    rng = random.Random(14)
    acked: dict[str, int] = {}
    deleted: set[str] = set()
    doubt: set[str] = set()
    for rnd in range(3):
        a, d, cut = _run_and_kill(path, rnd, mode, rng.randrange(3, 40), rng.uniform(0.0, 0.05))
        acked.update(a)
        deleted |= d
        doubt |= cut
        assert a, "the child acknowledged nothing before the kill"
        os.unlink(os.path.join(path, INDEX_FILE))  # the index is lost with the process
        st = await PageStore.open(path, small_config(ssd_durability_mode=mode, ssd_capacity_bytes=128 << 20))
        live = [k for k in acked if k not in deleted]
        outs = [np.zeros(acked[k], np.uint8) for k in live]
        ok = await st.get_many(live, outs)
        lost = [k for k, g in zip(live, ok) if not g and k not in doubt]
        wrong = [k for k, g, o in zip(live, ok, outs) if g and not np.array_equal(o, payload(k, acked[k]))]
        back = [k for k, e in zip(sorted(deleted), await st.exists_many(sorted(deleted))) if e]
        await st.close()
        assert (lost, wrong, back) == ([], [], []), (rnd, len(live))
