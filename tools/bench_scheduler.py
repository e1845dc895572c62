#!/usr/bin/env python3
"""``python tools/bench_scheduler.py [args]`` == ``umbp-nvme bench scheduler [args]``: the benchmark lives in
umbp_nvme/bench/scheduler.py (shipped with the package); this script runs it from a checkout."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from umbp_nvme.bench.scheduler import *  # noqa: E402,F401,F403 - the script's names, for whoever imported it
from umbp_nvme.bench.scheduler import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
