"""``Seam``: what ``UMBPNvmeStore`` hands its helpers (``stores``, ``transfers``).

The backend builds one ``Seam`` at construction and passes it to every helper call; the helpers
read and change its fields and nothing of the backend's. Its fields in three groups, by who
writes them:

- fixed at construction (the backend): the settings, the key scheme, the store directories;
- set at registration (the backend's ``register_*``): the host pools, their host ranges, the
  KV anchor's object suffixes and the namespace a store directory is opened with;
- the stores and their life (``stores``, under ``lock``): this rank's store, a
  follower's sidecar, closed, the follower's retry time, the KV-event publisher.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..config import StoreConfig
from .keys import KeyScheme, PoolRegistry, page_of

log = logging.getLogger("umbp_nvme.sglang_backend")

# The backend's own extra_config switches, beside StoreConfig's keys: key -> (type, default,
# meaning), as docs/sglang.md §9's table shows them (config_doc.py)
BACKEND_KEYS = {
    "prometheus": ("bool", "SGLang's `enable_storage_metrics`",
                   "export the store's `umbp_nvme_*` families with SGLang's metrics (docs/metrics.md)."),
    "doctor_at_start": ("bool", "false",
                        "log `umbp-nvme doctor`'s report (without its probe) when the store opens."),
}


@dataclass(eq=False)
class Seam:
    # -- fixed at construction
    config: StoreConfig
    storage_config: Any
    scheme: KeyScheme
    interface_v1: bool
    follower: bool  # an MLA follower: reads the writer rank's shared store, never writes it
    store_dirs: list[str]  # this rank's directory under every root (one per drive)
    private_dirs: list[str]  # a follower's sidecar directory under every root
    model_name: str = ""
    engine_factory: Optional[Callable] = None  # PageStore.open's hook (tests, fault injection)
    doctor_at_start: bool = False
    prometheus: bool = False
    events_cfg: Any = None  # kv_events config; None: no DISK events
    settings_from: dict = field(default_factory=dict)  # config field -> where it was set (config.config_sources)
    # -- set at registration
    registry: PoolRegistry = field(default_factory=PoolRegistry)
    anchor: Any = None  # the KV host pool (register_mem_pool_host)
    page_size: int = 1
    logical_anchor: bool = False  # an anchor without a kv_buffer: v1 I/O is a no-op
    envelope: bool = False  # one object per page holding the whole unified page
    v1_sfx: tuple[str, ...] = ()  # the KV anchor's per-page object suffixes
    namespace: Optional[dict] = None  # None until the anchor is registered: no store opens before
    ranges: list[tuple[int, int]] = field(default_factory=list)  # every pool's host tensors
    # -- the stores (stores.py)
    lock: threading.RLock = field(default_factory=threading.RLock)
    main: Any = None  # SyncPageStore: this rank's store, or the shared one (read-only on a follower)
    private: Any = None  # SyncPageStore: a follower's own TP-sharded side-pool state
    closed: bool = False
    next_follower_try: float = 0.0
    publisher: Any = None  # kv_events.Publisher once this rank's store is open
    residency: Any = None  # kv_residency.Residency hooked into that store
    logged: set[str] = field(default_factory=set)  # kinds log_once has logged
    page_of: Callable[[str], str] = field(init=False)  # key -> page hash, for placement over drives

    def __post_init__(self) -> None:
        if not self.v1_sfx:
            self.v1_sfx = self.scheme.v1_suffixes()
        self.page_of = functools.partial(page_of, config_prefix=self.scheme.config_prefix)

    @property
    def store_dir(self) -> str:
        """The store directories as one string, for messages."""
        return ",".join(self.store_dirs)

    def log_once(self, kind: str, msg: str, *args, level: int = logging.ERROR) -> None:
        """Log ``msg`` at ``level`` the first time ``kind`` happens, at DEBUG after that."""
        if kind in self.logged:
            log.debug("umbp_nvme: " + msg, *args)
            return
        self.logged.add(kind)
        log.log(level, "umbp_nvme: " + msg + " (logged once)", *args)
