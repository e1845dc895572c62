"""Gets into CUDA memory: GPUDirect Storage (kvikio) straight to the device, or O_DIRECT reads into
a host bounce checked there and copied to the device. A mixin of GetPath (get_path.py), which
sends a batch's CUDA destinations here once its host ones are planned.

Reads: state.gds_gate, state.read_engine, state.bounce (borrowed, given back), state.crc32c,
state.files, verify_crc, timeout_s.
"""

from __future__ import annotations

import asyncio

import numpy as np

from . import staging
from .index import FLAG_CRC
from .lookups import ReadBatch
from .staging import wait_out


class DeviceReads:
    async def _read_device_part(self, b: ReadBatch, route, lo: int, hi: int, good, verified) -> None:
        sl = slice(lo, hi)
        fds = self.state.files.batch(b.segs[sl])
        ok, checked = await asyncio.wait_for(
            self._read_device(route, fds, b.offs[sl], b.dst[sl], b.lens[sl], b.crcs[sl], b.flags[sl]), self.timeout_s
        )
        good[sl] = ok
        verified[sl] = checked

    async def _read_device(self, route: str, fds, offs, addrs, lens, crcs, flags) -> tuple[np.ndarray, np.ndarray]:
        """(complete, verified) per op for a read into CUDA memory."""
        from ..engine import gds

        gate = self.state.gds_gate
        verify = self.verify_crc
        got = None
        if route == "gds":
            res = await gate.engine.read_many(fds, offs, addrs, lens)
            if verify:
                got = await gds.device_crc32c_many(addrs, lens)
        else:
            # staging: O_DIRECT read of whole blocks into a host bounce, check, then copy to the device
            blen, starts, bounce = staging.device_layout(self.state.bounce, lens)
            try:
                host = np.uint64(bounce.address) + starts.astype(np.uint64)
                res = await self.state.read_engine.read_many(fds, offs, host, blen)
                ok = res >= lens
                crc32c = self.state.crc32c
                host_l, len_l = host.tolist(), lens.tolist()
                good_l = ok.tolist()

                def check_and_copy() -> list[bool]:
                    out = list(good_l)
                    if verify:
                        for j, (h, n) in enumerate(zip(host_l, len_l)):
                            if out[j] and flags[j] & FLAG_CRC and crc32c((h, n)) != int(crcs[j]):
                                out[j] = False
                    gds._device_ops.copy_h2d([(h, int(a), n) for h, a, n, o in zip(host_l, addrs.tolist(), len_l, out) if o])
                    return out

                # it copies into the caller's device memory until it returns
                checked = await wait_out(asyncio.get_running_loop().run_in_executor(None, check_and_copy))
                return ok, np.asarray(checked, bool)
            finally:
                self.state.bounce.put(bounce)
        ok = res >= lens
        checked = ok.copy()
        if got is not None:
            checked &= (got.astype(np.uint32) == crcs) | ((flags & FLAG_CRC) == 0)
        return ok, checked
