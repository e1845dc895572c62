"""The SGLang adapter: what serves SGLang's HiCache (docs/sglang.md), over the store below it.

- ``backend.py``: ``UMBPNvmeStore(HiCacheStorage)``, the L3 backend SGLang loads (its configs name
  ``umbp_nvme.sglang_backend.UMBPNvmeStore``, a thin alias of this one); ``seam.py``, the one object
  the backend hands its helpers; ``stores.py`` (opening and closing the stores), ``transfers.py``
  (the data paths); ``_hicache_standin.py``, SGLang's types when SGLang is not installed;
- ``keys.py``: every key format (SGLang's UMBP key scheme, the page behind a key, the pool
  registry); ``hits.py``: prefix-hit counting for ``batch_exists*``;
- DISK-tier KV events for routers (docs/fleet.md): ``kv_events.py`` (the publisher),
  ``kv_residency.py`` (the store's hooks -> page events), ``kv_relay.py`` (the engine's stream
  relayed, with token ids), ``kv_tokens.py`` (those tokens kept beside the store),
  ``_kv_event_structs.py`` (the event shapes without SGLang).

Nothing is imported here: ``umbp_nvme.sglang.keys`` costs no more than the module itself, and the
store, the engines and the command line (``umbp_nvme.cli``) never import this folder's backend.
"""
