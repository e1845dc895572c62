"""``python -m umbp_nvme.cli``: the ``umbp-nvme`` command."""

import sys

from .main import main

sys.exit(main())
