"""Object keys, exactly as SGLang's UMBP store composes them (docs/sglang.md §4).

A page hash becomes one or more *component keys*, one per object that `get_page_buffer_meta`
returns for the page, in the same order (page-major). KV (v1) keys carry a rank suffix and no
prefix; hybrid side-pool keys carry the rank suffix, the pool name and the `config_prefix`.
Keeping UMBP's formats byte for byte (including MLA's `h__k`) keeps logs, tools and tests
written for UMBP meaningful here.

Pure functions over plain data: nothing here imports sglang. Pool names may be sglang's
`PoolName` (a str enum whose value is the name) or plain strings; both render to the value.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

KV_POOL = "kv"
MAMBA_POOL = "mamba"
FLAT_KEY_PREFIX = "flat_"  # legacy whole-page objects (not interface_v1); v1 keys start with a 64-hex page hash

_HASH_RE = re.compile(r"(?:^|_)([0-9a-fA-F]{64})(?=_|$)")  # SGLang page hashes are 64 hex digits
_HEAD_RE = re.compile(r"[0-9a-fA-F]{64}(?=_|$)")  # the common case: the key starts with it


def pool_name_str(name: Any) -> str:
    """The pool's name as it appears in keys and messages: an enum's value, else str()."""
    if isinstance(name, Enum):
        return str(name.value)
    return str(name)


class UnregisteredPoolError(ValueError):
    """A v2 transfer names a pool that was never registered with register_mem_host_pool_v2."""

    def __init__(self, name: Any, registered: Sequence[str] = ()):
        self.pool_name = pool_name_str(name)
        listed = ", ".join(registered) if registered else "none"
        hint = (
            "Register it with register_mem_host_pool_v2(host_pool, name) before batch I/O."
            if self.pool_name != KV_POOL
            else "The KV anchor is never a side pool: it is registered with register_mem_pool_host "
            "and read and written through batch_get_v1 / batch_set_v1."
        )
        # The first sentence is UMBP's exact message; logs and tests match on it.
        super().__init__(f"Unregistered UMBP hybrid pool: {self.pool_name}. Registered pools: {listed}. {hint}")


class PoolRegistry:
    """Side pools by name (the value of sglang's PoolName). KV is never registered (spec §6.4)."""

    def __init__(self) -> None:
        self._pools: dict[str, Any] = {}
        self._lock = threading.Lock()

    def register(self, name: Any, pool: Any) -> bool:
        """Store `pool` under `name`; returns False (and stores nothing) for the KV anchor."""
        key = pool_name_str(name)
        if key == KV_POOL:
            return False
        with self._lock:
            self._pools[key] = pool
        return True

    def get(self, name: Any) -> Any:
        """The pool registered as `name`; raises UnregisteredPoolError (a ValueError) otherwise."""
        key = pool_name_str(name)
        pool = self._pools.get(key)
        if pool is None:
            raise UnregisteredPoolError(name, self.names())
        return pool

    def names(self) -> list[str]:
        with self._lock:
            return list(self._pools)

    def items(self) -> list[tuple[str, Any]]:
        with self._lock:
            return list(self._pools.items())

    def __contains__(self, name: Any) -> bool:
        return pool_name_str(name) in self._pools

    def __len__(self) -> int:
        return len(self._pools)


@dataclass(frozen=True)
class KeyScheme:
    """Rank suffixes and config prefix of one SGLang rank (spec §6.1)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla: bool = False
    split_factor: int = 0  # 0 = heads not split; else tp_lcm_size // tp_size
    config_prefix: str | None = None
    # Decode-context-parallel MLA (sglang 0.5.23): each DCP shard holds different bytes under the
    # same page hash, so its shard joins the MLA suffix, as Mooncake does. dcp_size == 1 keeps
    # UMBP's format.
    dcp_rank: int = 0
    dcp_size: int = 1
    attn_cp_rank: int = 0

    @classmethod
    def from_storage_config(cls, storage_config: Any) -> "KeyScheme":
        """Read an sglang HiCacheStorageConfig (or any object with some of its fields)."""
        if storage_config is None:
            return cls()
        tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        is_mla = bool(getattr(storage_config, "is_mla_model", False))
        split_factor = 0
        if getattr(storage_config, "should_split_heads", False):
            lcm = getattr(storage_config, "tp_lcm_size", None)
            if not lcm or lcm % tp_size or lcm // tp_size < 1:
                raise ValueError(
                    f"should_split_heads needs tp_lcm_size to be a positive multiple of tp_size, "
                    f"got tp_lcm_size={lcm!r}, tp_size={tp_size}"
                )
            split_factor = lcm // tp_size
        return cls(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=int(getattr(storage_config, "pp_rank", 0) or 0),
            pp_size=int(getattr(storage_config, "pp_size", 1) or 1),
            is_mla=is_mla,
            split_factor=split_factor,
            config_prefix=make_config_prefix(
                getattr(storage_config, "extra_config", None), getattr(storage_config, "model_name", None)
            ),
            dcp_rank=int(getattr(storage_config, "dcp_rank", 0) or 0),
            dcp_size=int(getattr(storage_config, "dcp_size", 1) or 1),
            attn_cp_rank=int(getattr(storage_config, "attn_cp_rank", 0) or 0),
        )

    # -- suffixes ------------------------------------------------------------------------------
    @property
    def enable_pp(self) -> bool:
        return self.pp_size > 1

    @property
    def rank_suffix(self) -> str:
        """This rank's own MHA suffix, never split: `{tp}` or `{tp}_{pp}`."""
        return f"{self.tp_rank}_{self.pp_rank}" if self.enable_pp else f"{self.tp_rank}"

    @property
    def mha_suffix(self) -> str | list[str]:
        """`{tp}` / `{tp}_{pp}`; with split heads a list, one per target rank tp*sf .. tp*sf+sf-1."""
        if self.split_factor:
            base = self.tp_rank * self.split_factor
            ranks = range(base, base + self.split_factor)
            return [f"{r}_{self.pp_rank}" if self.enable_pp else f"{r}" for r in ranks]
        return self.rank_suffix

    @property
    def mla_suffix(self) -> str:
        """`""` without PP (hence `h__k`), `{pp}` with PP."""
        if self.dcp_size > 1:
            return f"dcp{self.dcp_rank}_cp{self.attn_cp_rank}" + (f"_{self.pp_rank}" if self.enable_pp else "")
        return f"{self.pp_rank}" if self.enable_pp else ""

    def v1_suffixes(self, *, envelope: bool = False) -> tuple[str, ...]:
        """Per-page object suffixes of the KV anchor, in get_page_buffer_meta order."""
        if envelope:
            # One object per page holding the whole unified page. UMBP formats mha_suffix here
            # even when it is a split-heads list; an envelope is never split, so use the rank's own.
            return (f"_{self.rank_suffix}_kv",)
        if self.is_mla:
            return (f"_{self.mla_suffix}_k",)
        suffix = self.mha_suffix
        ranks = suffix if isinstance(suffix, list) else [suffix]
        return tuple(f"_{r}_{c}" for r in ranks for c in ("k", "v"))

    @property
    def multiplier(self) -> int:
        """Objects per KV page: MLA 1, MHA 2, split heads 2*sf (no envelope)."""
        return len(self.v1_suffixes())

    def v1_multiplier(self, *, envelope: bool = False) -> int:
        return len(self.v1_suffixes(envelope=envelope))

    @property
    def flat_suffix(self) -> str:
        """A legacy flat page's suffix: MLA's on MLA, else the rank's own."""
        return f"_{self.mla_suffix}" if self.is_mla else f"_{self.rank_suffix}"

    def flat_key(self, page_hash: str) -> str:
        """A legacy whole flat page's key; its own prefix keeps it apart from v1 component keys."""
        return f"{FLAT_KEY_PREFIX}{page_hash}{self.flat_suffix}"

    def v1_keys(self, page_hashes: Sequence[str], *, envelope: bool = False) -> list[str]:
        """KV object keys, page-major. No config_prefix (spec §6.2, unlike Mooncake)."""
        suffixes = self.v1_suffixes(envelope=envelope)
        return [f"{h}{s}" for h in page_hashes for s in suffixes]

    # -- hybrid side pools ---------------------------------------------------------------------
    def side_pool_suffixes(self, pool_name: Any, pool: Any, rank_suffix: str | None = None) -> list[str]:
        """Per-page object suffixes of a side pool, in its get_page_buffer_meta order (spec §6.3)."""
        name = pool_name_str(pool_name)
        if pool is None:
            raise UnregisteredPoolError(pool_name)
        mla = self.mla_suffix if rank_suffix is None else rank_suffix
        # Side pools are sharded by the rank's own TP rank; a split-heads list would format as
        # "['0', '1']" in UMBP, so the rank's own suffix stands in.
        mha = self.rank_suffix if rank_suffix is None else rank_suffix
        components = getattr(pool, "components", None)
        if name == MAMBA_POOL:
            conv_num = len(getattr(pool, "conv_buffer", None) or [])
            suffixes = [f"_{mha}_conv_{i}" for i in range(conv_num)]
            if getattr(pool, "temporal_state_elem_size", 1) > 0:
                suffixes = [f"_{mha}_temporal"] + suffixes
        elif components is not None and len(components) == 1:
            suffixes = [f"_{mla}_{name}"]
        elif components is not None and len(components) == 2:
            suffixes = [f"_{mha}_{name}"] if getattr(pool, "packed", False) else [f"_{mha}_{name}_k", f"_{mha}_{name}_v"]
        elif components is not None:
            raise ValueError(f"Unsupported UMBP component count for pool {name}: {len(components)}")
        elif self.is_mla:
            suffixes = [f"_{mla}_{name}"]
        elif getattr(pool, "v_buffer", None) is not None:
            suffixes = [f"_{mha}_{name}_k", f"_{mha}_{name}_v"]
        else:
            suffixes = [f"_{mha}_{name}"]
        return suffixes

    def side_pool_keys(
        self, page_hashes: Sequence[str], pool_name: Any, pool: Any, rank_suffix: str | None = None
    ) -> tuple[list[str], int]:
        """(component keys, objects per page) for a side pool; keys are page-major and prefixed."""
        suffixes = self.side_pool_suffixes(pool_name, pool, rank_suffix)
        keys = [f"{h}{s}" for h in page_hashes for s in suffixes]
        if self.config_prefix:
            keys = [f"{self.config_prefix}_{k}" for k in keys]
        return keys, len(suffixes)

    def component_keys(
        self, page_hashes: Sequence[str], pool_name: Any, registry: PoolRegistry, rank_suffix: str | None = None
    ) -> tuple[list[str], int]:
        """side_pool_keys with the pool looked up in `registry` (raises UnregisteredPoolError)."""
        return self.side_pool_keys(page_hashes, pool_name, registry.get(pool_name), rank_suffix)


def hash_str_to_int64(page_key: str) -> int:
    """SGLang's KV-event hash of a page key (``sglang.srt.mem_cache.utils.hash_str_to_int64``):
    its first 16 hex digits as a signed int64."""
    v = int(page_key[:16], 16)
    return v - (1 << 64) if v >= (1 << 63) else v


def page_of(key: str, config_prefix: str | None = None) -> str:
    """The page hash part of a component key (the part before the rank / MLA / pool suffixes).

    A 64-hex-digit run is the page hash wherever it sits (side-pool keys carry a config prefix
    in front of it); otherwise the config prefix and the legacy ``flat_`` prefix are removed
    and the part before the first ``_`` is the page.
    """
    m = _HEAD_RE.match(key)
    if m is not None:
        return m.group(0)
    m = _HASH_RE.search(key)
    if m is not None:
        return m.group(1)
    if config_prefix and key.startswith(config_prefix + "_"):
        key = key[len(config_prefix) + 1:]
    if key.startswith(FLAT_KEY_PREFIX):
        key = key[len(FLAT_KEY_PREFIX):]
    head, _, _ = key.partition("_")
    return head or key


def make_config_prefix(extra_config: Mapping | None, model_name: str | None) -> str | None:
    """`{extra_backend_tag}_{model with / -> -}`, either part optional; None when both are absent."""
    parts = []
    extra = extra_config or {}
    if extra.get("extra_backend_tag") is not None:
        parts.append(str(extra["extra_backend_tag"]))
    if model_name:
        parts.append("-".join(str(model_name).split("/")))
    return "_".join(parts) if parts else None


# ---------------------------------------------------------------------------------------------
# Rank placement on disk (spec §6.10).


def is_mla_follower(storage_config: Any) -> bool:
    """True for ranks that read a shared MLA store but never write it.

    MLA KV is replicated across TP ranks, so with tp_size > 1 one rank writes and the others
    read what it wrote. sglang 0.5.23's `is_storage_writer` names the writer (rank 0, or one per
    DCP shard); older configs fall back to UMBP's rule, TP rank 0.
    """
    if storage_config is None or not getattr(storage_config, "is_mla_model", False):
        return False
    if int(getattr(storage_config, "tp_size", 1) or 1) <= 1:
        return False
    writer = getattr(storage_config, "is_storage_writer", None)
    if isinstance(writer, bool):
        return not writer
    return int(getattr(storage_config, "tp_rank", 0) or 0) != 0


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def dp_rank_hint(storage_config: Any, env: Mapping[str, str] | None = None) -> int | None:
    """The data-parallel rank when DP is in use: SGLANG_DP_RANK, else the config's dp_rank when
    it is non-zero or dp_size > 1; None without DP."""
    env = os.environ if env is None else env
    hint = _env_int(env, "SGLANG_DP_RANK")
    if hint is not None:
        return hint
    dp_rank = int(getattr(storage_config, "dp_rank", 0) or 0)
    dp_size = int(getattr(storage_config, "dp_size", 1) or 1)
    if dp_rank > 0 or dp_size > 1:
        return dp_rank
    return None


def unique_rank(storage_config: Any, env: Mapping[str, str] | None = None) -> int:
    """LOCAL_RANK if set, else ((dp * pp_size) + pp_rank) * tp_size + tp_rank."""
    env = os.environ if env is None else env
    local = _env_int(env, "LOCAL_RANK")
    if local is not None:
        return local
    dp = dp_rank_hint(storage_config, env) or 0
    tp_size = max(int(getattr(storage_config, "tp_size", 1) or 1), 1)
    pp_size = max(int(getattr(storage_config, "pp_size", 1) or 1), 1)
    pp_rank = int(getattr(storage_config, "pp_rank", 0) or 0)
    tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
    return ((dp * pp_size) + pp_rank) * tp_size + tp_rank


def rank_subdir(storage_config: Any, env: Mapping[str, str] | None = None) -> str:
    """Subdirectory of ssd_storage_dir for this rank: "", "tp1", "pp1_tp0", "dp1_tp0", "rank3".

    MHA ranks hold different bytes under the same page hash only through their key suffixes, but
    a store has one writer, so each rank gets its own directory. MLA with TP > 1 shares one
    directory per DP group, PP stage and DCP shard (one writer, TP rank 0 or the shard's writer;
    the other TP ranks read it).
    """
    env = os.environ if env is None else env
    if storage_config is None:
        return ""
    dp = dp_rank_hint(storage_config, env)
    tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
    pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
    shared_mla = bool(getattr(storage_config, "is_mla_model", False)) and tp_size > 1
    parts = []
    if dp is not None:
        parts.append(f"dp{dp}")
    if pp_size > 1:
        parts.append(f"pp{int(getattr(storage_config, 'pp_rank', 0) or 0)}")
    if shared_mla:
        # sglang 0.5.23 DCP: one writer per DCP shard (is_storage_writer), each with its own bytes
        # and keys; a shard's TP replicas read its writer's directory.
        dcp_size = int(getattr(storage_config, "dcp_size", 1) or 1)
        if dcp_size > 1:
            parts.append(f"dcp{int(getattr(storage_config, 'dcp_rank', 0) or 0)}")
        return "_".join(parts)
    if tp_size > 1:
        parts.append(f"tp{int(getattr(storage_config, 'tp_rank', 0) or 0)}")
    if not parts:
        u = unique_rank(storage_config, env)
        if u != 0:
            parts.append(f"rank{u}")
    return "_".join(parts)
