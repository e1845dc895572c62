"""Inert stand-in for ``torchvision``, used only where SGLang is driven on CPU (bench hicache, the tests).

``sglang.srt.configs`` imports ``torchvision.transforms`` at module level (for
vision-language model preprocessing), and through it ``transformers`` imports
``torchvision.io``. The PyPI torchvision wheel does not load beside the CPU
torch build installed here, and the KV-cache code paths we test never run an
image transform. This package satisfies those imports: every
``torchvision.<sub>`` module is synthesised on import and every attribute is
an inert placeholder that raises when called, so a test can never silently
depend on it. ``InterpolationMode`` is a real enum because libraries build
lookup tables from its members at import time.
"""

import sys

from ._inert import InterpolationMode, ShimFinder, make_module_getattr

__version__ = "0.0.0+umbp-nvme-test-shim"
__getattr__ = make_module_getattr(__name__)

if not any(isinstance(f, ShimFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, ShimFinder(__name__))
