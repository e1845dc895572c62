"""Which drives' pages a router may count on: a multi-drive store's side of the KV events.

A mixin of ``drives.MultiDriveStore``. The residency tracker (kv_residency.py) hears from each
drive's PageStore which keys became visible there; what a router sees is the whole store, so:

- only drives that serve reads are hooked: a drive that stops serving (degraded, not merely full)
  is unhooked and its pages are reported hidden at once (each page no other drive serves becomes
  one BlockRemoved); what happens on it meanwhile (owed deletes and clears applied, a stalled
  put that completes late) is invisible to lookups and announces nothing;
- a drive that serves again (re-admitted by the probe, or opened late) is hooked again and its
  pages reported shown (BlockStored), after its owed deletes and clears were applied;
- the re-announcement takes only the keys of drives that serve (``served_keys``).

Reads: the drive stores' keys(). Changes: each drive store's writer.residency (attach_residency /
detach_residency), the MultiDriveStore's _residency.
"""

from __future__ import annotations

import logging

log = logging.getLogger("umbp_nvme.store")


class DriveResidency:
    _residency = None  # kv_residency.Residency, when KV events are published

    @property
    def residency(self):
        """The kv_residency.Residency the drives that serve reads tell; None when none is."""
        return self._residency

    def attach_residency(self, residency) -> None:
        self._residency = residency
        for d, h in enumerate(self.health):
            h.on_readable = self._readable_changed
            st = self.stores[d]
            if st is not None:
                st.attach_residency(residency if h.readable else None)

    def detach_residency(self) -> None:
        self._residency = None
        for h, st in zip(self.health, self.stores):
            h.on_readable = None
            if st is not None:
                st.detach_residency()

    def served_keys(self) -> list[str]:
        """Every published key on the drives that serve reads (a snapshot)."""
        out: dict[str, None] = {}
        for st, h in zip(self.stores, self.health):
            if st is not None and h.readable:
                out.update(dict.fromkeys(st.keys()))
        return list(out)

    def _readable_changed(self, d: int, readable: bool) -> None:
        rz, st = self._residency, self.stores[d]
        if rz is None or st is None:
            return
        try:
            keys = st.keys()
        except Exception as e:  # noqa: BLE001 - events never fail a state change
            log.debug("drive %d: its keys for the KV events: %r", d, e)
            return
        if readable:
            st.attach_residency(rz)
            rz.shown(keys)
        else:
            st.detach_residency()
            rz.hidden(keys)
