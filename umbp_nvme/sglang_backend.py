"""The name SGLang configs use: ``"module_path": "umbp_nvme.sglang_backend", "class_name":
"UMBPNvmeStore"`` (README, docs/sglang.md). The backend lives in ``umbp_nvme/sglang/backend.py``;
this alias keeps that name working and holds nothing else."""

from .sglang.backend import UMBPNvmeStore

__all__ = ["UMBPNvmeStore"]
