#!/usr/bin/env python3
"""``python tools/bench_server.py [args]`` == ``umbp-nvme bench server [args]``: the benchmark lives in
umbp_nvme/bench/server.py (shipped with the package); this script runs it from a checkout."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from umbp_nvme.bench.server import *  # noqa: E402,F401,F403 - the script's names, for whoever imported it
from umbp_nvme.bench.server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
