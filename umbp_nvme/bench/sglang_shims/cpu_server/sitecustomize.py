"""Test support: makes SGLang 0.5.23's real HTTP server run on a CPU-only machine.

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that has one, so
putting this directory on the server's PYTHONPATH (umbp_nvme/bench/server_launch.py does; nothing
in the package's runtime does) applies the patches in the server process and in every scheduler /
detokenizer process it spawns. Each patch is applied right after SGLang imports the module it
changes (an import hook), so a process that never imports SGLang pays nothing.
"""

from __future__ import annotations

import os

if os.environ.get("UMBP_SGLANG_CPU_SHIMS") == "1":
    import umbp_cpu_server_patches

    umbp_cpu_server_patches.install()
