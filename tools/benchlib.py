"""Old name of umbp_nvme.bench.common (the benchmarks' shared helpers): the same module object."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from umbp_nvme.bench import common as _common  # noqa: E402

sys.modules[__name__] = _common
