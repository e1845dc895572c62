"""A writer over several drive directories for the drive tests: its engines go through a
FaultPlan, it holds K and V pages on every drive, and one drive can be made to answer EIO."""

from __future__ import annotations

import numpy as np

from conftest import payload, small_config
from support.faults import FaultPlan, FaultRule, on_files_under
from umbp_nvme.store import PageStore

OBJ = 16 << 10


def page_keys(pages: int, tag: str = "p") -> list[str]:
    return [f"{tag}{i:04d}_0_{c}" for i in range(pages) for c in "kv"]


def drive_roots(tmp_path, n: int) -> list[str]:
    return [str(tmp_path / f"drive{i}" / "store") for i in range(n)]


async def filled_writer(tmp_path, pages: int, *, n: int = 2, probe_interval_s: float = 60, hooks=None, **config):
    """(roots, plan, writer, keys): ``pages`` pages written through a writer over ``n`` drives
    (``hooks``: a StoreHooks for PageStore.open)."""
    roots, plan = drive_roots(tmp_path, n), FaultPlan()
    st = await PageStore.open(roots, small_config(**config), engine_factory=plan.engine_factory(),
                              probe_interval_s=probe_interval_s, hooks=hooks)  # fmt: skip
    keys = page_keys(pages)
    assert await st.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * len(keys)
    return roots, plan, st, keys


async def degrade_by_eio(plan, st, root: str, keys: list[str], limit: int | None = None) -> None:
    """Reads under ``root`` answer EIO (``limit`` times, or always); one get of ``keys[0]`` marks the drive degraded."""
    plan.set_rules([FaultRule("eio", ops=("read",), predicate=on_files_under(root), limit=limit)])
    await st.get_many(keys[:1], [np.zeros(OBJ, np.uint8)])
