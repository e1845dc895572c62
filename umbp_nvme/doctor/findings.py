"""What every doctor check (report.py, probe.py) shares: a finding, and where to look."""

from __future__ import annotations

import os

from ..store.mounts import nearest_above


def finding(findings: list, item: str, level: str, message: str, fix: str = "") -> None:
    """One item of the report: level ``ok`` | ``info`` | ``warn`` | ``fail``, and a plain-language fix."""
    findings.append({"item": item, "level": level, "message": message, "fix": fix})


def existing(path: str) -> str:
    """``path``, or the nearest directory above it that exists (a store not created yet)."""
    return nearest_above(path, os.path.exists)
