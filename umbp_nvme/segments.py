"""Old import path: ``umbp_nvme.segments`` is ``umbp_nvme.store.segments`` (the same module object, so
monkeypatching either name patches both)."""

import sys

from .store import segments as _module

sys.modules[__name__] = _module
