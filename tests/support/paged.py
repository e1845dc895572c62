"""Keys and byte-checked gets of small paged objects, shared by the doubt and record-cache tests."""

from __future__ import annotations

import numpy as np

from conftest import payload

OBJ = 16 << 10


def page_keys(pages: int, tag: str = "p") -> list[str]:
    """SGLang-shaped keys: a k and a v object per page."""
    return [f"{tag}{i:04d}_0_{c}" for i in range(pages) for c in "kv"]


async def get_checked(st, keys, nbytes: int = OBJ) -> tuple[list[bool], int]:
    """(results, how many answered True with bytes other than the key's payload)."""
    outs = [np.zeros(nbytes, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    wrong = sum(1 for ok, k, o in zip(res, keys, outs) if ok and not np.array_equal(o, payload(k, nbytes)))
    return res, wrong


async def served(st, want: dict, nbytes: int) -> tuple[int, list]:
    """(hits, keys served with other bytes than ``want[key]``, or served at all where it is None)."""
    keys = list(want)
    outs = [np.zeros(nbytes, np.uint8) for _ in keys]
    ok = await st.get_many(keys, outs)
    wrong = [k for k, g, o in zip(keys, ok, outs) if g and (want[k] is None or not np.array_equal(o, want[k]))]
    return sum(ok), wrong
