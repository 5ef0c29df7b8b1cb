"""The light eagle3 SDK (no torch): prepare datasets, pull features from an extraction server.

``ExtractionClient`` (``sdk.py``; ``AsyncExtractionClient`` in ``async_sdk.py`` for asyncio) for a few
samples into a notebook, ``extract_dataset``
(``extract.py``) for whole datasets to disk, resumably; ``prepare_dataset`` (``prepare.py``) to
tokenize and mask conversations first. The same names are re-exported from ``eagle3``. Loaded on
first use, so importing one submodule loads only what it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3.core.lazy import lazy_exports

_EXPORTS = {
    "AsyncExtractionClient": "eagle3.client.async_sdk",
    "ExtractionClient": "eagle3.client.sdk",
    "extract_dataset": "eagle3.client.extract",
    "ExtractConfig": "eagle3.client.extract",
    "prepare_dataset": "eagle3.client.prepare",
    "PrepareConfig": "eagle3.client.prepare",
    "PrepareError": "eagle3.client.prepare",
}

if TYPE_CHECKING:
    from eagle3.client.async_sdk import AsyncExtractionClient
    from eagle3.client.extract import ExtractConfig, extract_dataset
    from eagle3.client.prepare import PrepareConfig, PrepareError, prepare_dataset
    from eagle3.client.sdk import ExtractionClient

__all__ = [
    "AsyncExtractionClient",
    "ExtractConfig",
    "ExtractionClient",
    "PrepareConfig",
    "PrepareError",
    "extract_dataset",
    "prepare_dataset",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
