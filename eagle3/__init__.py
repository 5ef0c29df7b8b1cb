"""eagle3: train EAGLE-3 speculative-decoding drafts against a resident verifier.

One installed namespace, four packages under it, each a folder at the top of the repository
(``eagle3/core`` -> ``core/`` and so on; docs/architecture.md draws the layers)::

    eagle3.core           the contract every other package stands on (imports nothing of ours)
    eagle3.client         the light SDK (no torch): prepare, ExtractionClient, extract_dataset
    eagle3.server         the resident extraction server (FastAPI, backends hf | vllm | synthetic)
    eagle3.draft_trainer  vocab, the draft model, training, export, evaluation
    eagle3.cli, .demo     the console script on top of all of them

The SDK's main names are re-exported here, loaded on first use so that importing a leaf such as
``eagle3.core.protocol.frames`` loads nothing else::

    from eagle3 import ExtractionClient
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3.core.lazy import lazy_exports

__version__ = "0.1.0"

# name -> module that defines it; resolved lazily by __getattr__ (PEP 562)
_EXPORTS = {
    "AsyncExtractionClient": "eagle3.client.async_sdk",
    "ExtractionClient": "eagle3.client.sdk",
    "ExtractedSample": "eagle3.core.sample",
    "extract_dataset": "eagle3.client.extract",
    "ExtractConfig": "eagle3.client.extract",
    "prepare_dataset": "eagle3.client.prepare",
    "PrepareConfig": "eagle3.client.prepare",
    "FeaturesReader": "eagle3.core.features_reader",
    "Eagle3Error": "eagle3.core.errors",
    "train_from_servers": "eagle3.train",
}

if TYPE_CHECKING:
    from eagle3.client.async_sdk import AsyncExtractionClient
    from eagle3.client.extract import ExtractConfig, extract_dataset
    from eagle3.client.prepare import PrepareConfig, prepare_dataset
    from eagle3.client.sdk import ExtractionClient
    from eagle3.core.errors import Eagle3Error
    from eagle3.core.features_reader import FeaturesReader
    from eagle3.core.sample import ExtractedSample
    from eagle3.train import train_from_servers

__all__ = [
    "AsyncExtractionClient",
    "Eagle3Error",
    "ExtractConfig",
    "ExtractedSample",
    "ExtractionClient",
    "FeaturesReader",
    "PrepareConfig",
    "extract_dataset",
    "prepare_dataset",
    "train_from_servers",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
