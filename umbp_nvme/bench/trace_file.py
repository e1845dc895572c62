"""Serving traces in Mooncake's FAST'25 format: read one, or make a synthetic multi-turn one.

One JSON object per line: ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens),
``hash_ids`` (the request's prefix blocks, one per 512 tokens; an identical id is a reusable
block, and ids are prefix-unique: the same id always follows the same parent). ``load`` maps the
ids onto dense ints 0..n_blocks-1 so the simulator and the replay index arrays with them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces


@dataclass
class Trace:
    reqs: list[np.ndarray]  # dense block ids per request (int64), in trace order
    input_tokens: np.ndarray  # per request
    timestamps_ms: np.ndarray
    block_ids: np.ndarray  # dense id -> the file's hash id
    path: str = ""

    @property
    def n_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def total_blocks(self) -> int:
        return int(sum(len(r) for r in self.reqs))

    def head(self, n: int) -> "Trace":
        """The first n requests (ids stay dense over the whole file)."""
        return Trace(self.reqs[:n], self.input_tokens[:n], self.timestamps_ms[:n], self.block_ids, self.path)


def _field(obj, name: str, line: int, path: str) -> int:
    v = obj.get(name)
    if type(v) is not int or v < 0:
        raise ValueError(f"{path}:{line}: {name!r} must be a non-negative int, got {v!r}")
    return v


def load(path: str, *, limit: int | None = None) -> Trace:
    """Read a FAST'25-format trace (the first ``limit`` requests when given); ValueError names
    the line of a malformed record."""
    raw: list[list[int]] = []
    tokens, stamps = [], []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(raw) >= limit:
                break
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
            ids = obj.get("hash_ids")
            if not isinstance(ids, list) or not all(type(h) is int for h in ids):
                raise ValueError(f"{path}:{line_no}: 'hash_ids' must be a list of ints")
            tokens.append(_field(obj, "input_length", line_no, path))
            stamps.append(obj.get("timestamp", 0))
            raw.append(ids)
    if not raw:
        raise ValueError(f"{path}: no requests in the trace")
    flat = np.fromiter((h for ids in raw for h in ids), np.int64, sum(map(len, raw)))
    block_ids, dense = np.unique(flat, return_inverse=True)
    cuts = np.cumsum([len(ids) for ids in raw])[:-1]
    reqs = np.split(dense.astype(np.int64), cuts)
    return Trace(reqs, np.asarray(tokens, np.int64), np.asarray(stamps, np.float64), block_ids, path)


def synthetic(requests: int = 2000, *, seed: int = 0, prompts: int = 8, prompt_blocks: tuple[int, int] = (2, 12),
              turn_blocks: tuple[int, int] = (1, 6), continue_p: float = 0.7, one_off_p: float = 0.2,
              active: int = 64, rate_per_s: float = 4.0) -> list[dict]:
    """A multi-turn serving trace as FAST'25 records: sessions start from one of ``prompts``
    shared system prompts, each turn extends its own last prefix by a few blocks and continues
    with probability ``continue_p``; ``one_off_p`` of requests are single unshared requests;
    ``active`` sessions interleave; Poisson arrivals. Deterministic per seed."""
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system = [fresh(int(rng.integers(prompt_blocks[0], prompt_blocks[1] + 1))) for _ in range(prompts)]
    sessions: list[list[int]] = []
    out: list[dict] = []
    t = 0.0
    for _ in range(requests):
        t += rng.exponential(1000.0 / rate_per_s)
        if rng.random() < one_off_p:
            ids = fresh(int(rng.integers(turn_blocks[0], 4 * turn_blocks[1])))
        else:
            if len(sessions) < active or rng.random() < 0.1:
                sessions.append(list(system[int(rng.integers(prompts))]))
                k = len(sessions) - 1
            else:
                k = int(rng.integers(len(sessions)))
            sessions[k] = sessions[k] + fresh(int(rng.integers(turn_blocks[0], turn_blocks[1] + 1)))
            ids = sessions[k]
            if rng.random() > continue_p:
                sessions.pop(k)
        out.append({"timestamp": int(t), "input_length": len(ids) * BLOCK_TOKENS - int(rng.integers(0, BLOCK_TOKENS)),
                    "output_length": int(rng.integers(1, 400)), "hash_ids": list(ids)})  # fmt: skip
    return out


def write(records: list[dict], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


@dataclass(kw_only=True)
class HitRates:
    """What every replay counts (the simulator's and the store's), and the block- and token-weighted
    prefix hit rates of it."""

    requests: int = 0
    total_blocks: int = 0
    hit_blocks: int = 0
    l2_hit_blocks: int = 0  # served by the host tier in front
    total_tokens: int = 0
    hit_tokens: int = 0
    held_sum: int = 0  # blocks (or objects) held, summed over the samples

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0
