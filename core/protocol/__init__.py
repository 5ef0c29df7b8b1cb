"""The contract shared by the server, the SDK and the trainer (stdlib only).

Everything here is plain data: frozen dataclasses, file names and one schema version. Nothing in
this package imports torch, fastapi, httpx or any other part of eagle3, so every component (and a
notebook with only the light SDK installed) can depend on it.
"""

from eagle3.core.protocol.prepared import (
    META_FILE,
    SAMPLES_FILE,
    SCHEMA_VERSION,
    STATS_FILE,
    PreparedFormatError,
    PreparedMeta,
    PreparedSample,
    iter_prepared,
    read_meta,
)

__all__ = [
    "META_FILE",
    "SAMPLES_FILE",
    "SCHEMA_VERSION",
    "STATS_FILE",
    "PreparedFormatError",
    "PreparedMeta",
    "PreparedSample",
    "iter_prepared",
    "read_meta",
]
