"""Small PageStores for the CLI tests: write items, read them back through the store's own read
path, and run `umbp-nvme` in-process."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
from conftest import payload

import umbp_nvme.cli.main as cli
from umbp_nvme.cli.maintenance import StoreReader
from umbp_nvme.config import StoreConfig
from umbp_nvme.sglang.keys import KeyScheme
from umbp_nvme.store import PageStore

MiB = 1 << 20
CAP = ["--capacity", "64m", "--config", '{"ssd_segment_size_bytes": 1048576, "ssd_durability_mode": "relaxed"}']


def _cfg() -> StoreConfig:
    return StoreConfig(ssd_capacity_bytes=64 * MiB, ssd_segment_size_bytes=1 * MiB, ssd_durability_mode="relaxed")


def make_store(path: str, items: dict[str, bytes], namespace: dict | None = None) -> None:
    async def run():
        s = await PageStore.open(path, _cfg(), namespace=namespace)
        try:
            bufs = [np.frombuffer(bytearray(v), np.uint8) for v in items.values()]
            assert all(await s.put_many(list(items), bufs))
        finally:
            await s.close()

    asyncio.run(run())


def read_store(path: str, keys) -> dict[str, bytes | None]:
    """Through the store's own read path (not the CLI's raw reader)."""

    with StoreReader(path) as r:
        lengths = {k: (rec.length if rec else 1) for k, rec in zip(keys, r.lookup(list(keys)))}

    async def run():
        s = await PageStore.open(path, _cfg(), readonly=True)
        try:
            out = {}
            for k in keys:
                n = lengths[k]
                buf = np.zeros(n, np.uint8)
                ok = (await s.get_many([k], [buf]))[0]
                out[k] = buf.tobytes() if ok else None
            return out
        finally:
            await s.close()

    return asyncio.run(run())


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def items(n: int, size: int = 12 * 1024, tag: str = "p") -> dict[str, bytes]:
    keys = KeyScheme().v1_keys([hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)])
    return {k: payload(k, size).tobytes() for k in keys}
