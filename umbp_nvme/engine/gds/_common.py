"""Constants, the logger and the package lookup shared by the modules of ``umbp_nvme.engine.gds``."""

from __future__ import annotations

import logging
import sys

from ...buffers import DIO_ALIGN_BYTES

# One logger for the whole package, named as before the split (callers filter on it).
log = logging.getLogger(__package__)

GDS_UNAVAILABLE = (
    "CUDA buffer given but GPUDirect Storage is unavailable: {reason}; "
    "install umbp_nvme[gds] on a CUDA machine or pass host memory"
)
PROBE_BYTES = 4096
DEFAULT_QUEUE_DEPTH = 64
MAX_BATCH_WORKERS = 4  # batches running at once; each keeps its ops in kvikio's thread pool
MAX_SHORT_RETRIES = 2  # a short transfer that is not at EOF is retried for the remainder this often
STAGING_ALIGN_BYTES = DIO_ALIGN_BYTES  # host files may be O_DIRECT: ops are rounded to it

READ = 0
WRITE = 1


def pkg():
    """The ``umbp_nvme.engine.gds`` package module.

    Names that callers and tests replace on the package (``_device_ops``, ``gds_available``,
    ``_import_kvikio``, ``_check_libcuda``, ``_check_torch_cuda``, ``_check_kvikio``, ``open_gds_engine``,
    ``StagingBuffer``, ``host_crc32c``) are looked up here at call time, so a replacement made with
    ``setattr(gds, name, ...)`` reaches every module of the package, as it did when it was one module.
    """
    return sys.modules[__package__]
