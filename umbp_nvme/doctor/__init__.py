"""The doctor: what a store will use on this machine and what the machine can do, each finding
with its fix (docs/cli.md, "doctor").

- ``report.py``: every check and the report (``report``, ``format_text``, ``log_report``);
- ``findings.py``: what every check shares (a finding, the nearest existing directory);
- ``probe.py``: the measured probe (put/get through a scratch store against raw I/O).

Below both of its callers: ``umbp-nvme doctor`` (cli/) and the SGLang backend's report at open
(sglang/stores.py, ``doctor_at_start``); it imports neither. Nothing is imported here.
"""
