"""Test support, not the real ``sgl_kernel``: the two CPU ops SGLang 0.5.23's CPU server calls.

The PyPI ``sgl_kernel`` wheel is a CUDA build and its CPU build is compiled from source; SGLang's
CPU path calls only these two while serving (``kernels/ops/kvcache/cache_move.py`` and
``srt/mem_cache/allocation.py``); each is the op's contract in plain torch indexing. Every other
name SGLang imports at module level (speculative decoding, MoE, ...) is a placeholder that raises
when called, so nothing can silently depend on it. Only the
real-server test and ``umbp-nvme bench server`` put this directory on the server's PYTHONPATH.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+umbp-nvme-cpu-test-shim"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def not_provided(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not provided by the CPU test shim "
                                  "(umbp_nvme/bench/sglang_shims/cpu_server)")

    not_provided.__name__ = name
    return not_provided


def _rows(ptr: int, stride_bytes: int, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of a device KV buffer known only by its address (SGLang passes a
    table of buffer addresses, as its CUDA kernel takes them)."""
    raw = (ctypes.c_uint8 * (rows * stride_bytes)).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride_bytes)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """Every buffer's row ``src_loc[i]`` copied to row ``tgt_loc[i]`` (KV slots moved)."""
    if tgt_loc.numel() == 0:
        return
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"copy_all_layer_kv_cache_cpu: {tgt_loc.numel()} targets for {src_loc.numel()} sources")
    tgt, src = tgt_loc.long(), src_loc.long()
    rows = int(max(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buf = _rows(int(ptr), int(stride), rows)
        buf[tgt] = buf[src]  # gathers every source before writing: overlapping sets are safe


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Request i's token slots ``start[i]:end[i]`` take the next ``end[i] - start[i]`` entries of
    ``out_cache_loc`` (the requests' new locations, concatenated in order)."""
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: slots {start}:{end} outside a row of {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[at : at + end - start]
        at += end - start
