"""Crash consistency: a writer SIGKILLed at random moments never leaves a wrong byte or loses an ack."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

from conftest import ROOT, MiB, payload, small_config
from umbp_nvme.store import PageStore

CHILD = r"""
import asyncio, os, random, sys
sys.path[:0] = [{root!r}, {tests!r}]
from conftest import payload, small_config
from umbp_nvme.store import PageStore

async def main(path, ack_path, rnd, seed, mode, cap):
    st = await PageStore.open(path, small_config(ssd_durability_mode=mode, ssd_capacity_bytes=cap,
                                                 ssd_segment_size_bytes=2 << 20))
    fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    rng = random.Random(seed)
    print("ready", flush=True)
    prev = []
    for i in range(400):
        ks = [f"r{{rnd}}-{{i}}-{{j}}-{{rng.choice([4096, 5000, 20000, 65536])}}" for j in range(8)]
        r = await st.put_many(ks, [payload(k, int(k.rsplit("-", 1)[1])) for k in ks])
        os.write(fd, "".join(f"+{{k}}\n" for k, ok in zip(ks, r) if ok).encode())
        if i % 4 == 3 and prev:  # deletes make slots come back into use under the crash
            gone = prev[:3]
            os.write(fd, "".join(f"-{{k}}\n" for k in gone).encode())
            await st.delete_many(gone)
        prev = [k for k, ok in zip(ks, r) if ok]
    await st.close()

asyncio.run(main(*sys.argv[1:5], sys.argv[5], int(sys.argv[6])))
"""


def _run_and_kill(path, ack, rnd, mode, cap, rng) -> None:
    script = CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    p = subprocess.Popen(
        [sys.executable, "-c", script, path, ack, str(rnd), str(rng.randrange(1 << 30)), mode, str(cap)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert p.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.01, 0.35))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()


def _acks(ack_path) -> tuple[set[str], set[str]]:
    """(keys acknowledged and never deleted, keys whose delete may have started)."""
    acked, maybe_gone = set(), set()
    try:
        with open(ack_path) as f:
            for line in f:
                if not line.endswith("\n"):
                    continue  # torn last line
                k = line[1:-1]
                (acked if line[0] == "+" else maybe_gone).add(k)
    except FileNotFoundError:
        pass
    return acked - maybe_gone, maybe_gone


async def _verify(path, mode, cap, acked, must_exist: bool, rng) -> int:
    st = await PageStore.open(path, small_config(ssd_durability_mode=mode, ssd_capacity_bytes=cap,
                                                 ssd_segment_size_bytes=2 << 20))
    try:
        existing = st.keys()
        if must_exist:
            have = set(existing)
            missing = [k for k in acked if k not in have]
            assert not missing, f"acknowledged keys lost: {missing[:5]}"
        # every existing key reads back exactly its bytes (sampled across rounds to stay fast)
        sample = existing if len(existing) <= 400 else rng.sample(existing, 400)
        outs = [np.zeros(int(k.rsplit("-", 1)[1]), np.uint8) for k in sample]
        res = await st.get_many(sample, outs)
        assert all(res), f"{res.count(False)} existing keys failed to read back"
        for k, o in zip(sample, outs):
            assert bytes(o) == bytes(payload(k, len(o))), f"wrong bytes for {k}"
        return len(existing)
    finally:
        await st.close()


def test_sigkill_20_times_strict_keeps_every_ack_and_no_wrong_byte(tmp_path):
    path, ack = str(tmp_path / "store"), str(tmp_path / "acks")
    rng = random.Random(1234)
    # Large enough that no eviction can run (segments are created lazily, so it costs no disk):
    # 20 children x 400 rounds x 8 objects of <= 64 KiB stay under the 0.9 high watermark.
    cap = 4096 * MiB
    seen = 0
    for rnd in range(20):
        _run_and_kill(path, ack, rnd, "strict", cap, rng)
        acked, _ = _acks(ack)
        seen = asyncio.run(_verify(path, "strict", cap, acked, True, rng))
    assert seen > 20  # the children did write between kills


def test_sigkill_relaxed_with_eviction_never_serves_a_wrong_byte(tmp_path):
    path, ack = str(tmp_path / "store"), str(tmp_path / "acks")
    rng = random.Random(99)
    cap = 6 * MiB  # small: eviction and slot reuse run while the writer is killed
    for rnd in range(5):
        _run_and_kill(path, ack, rnd, "relaxed", cap, rng)
        acked, _ = _acks(ack)
        asyncio.run(_verify(path, "relaxed", cap, acked, False, rng))
