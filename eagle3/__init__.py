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

and so is the error tree, as openai-python's is (one root, ``Eagle3Error``; eagle3.client.errors
draws it)::

    from eagle3 import APIError, Eagle3Error, RateLimitError
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
    "FeaturesDataset": "eagle3.core.features_dataset",
    "Eagle3Error": "eagle3.core.errors",
    "FeaturesLockedError": "eagle3.core.errors",
    "FeaturesWriteError": "eagle3.core.errors",
    "IncompatibleError": "eagle3.core.errors",
    "InsufficientDiskError": "eagle3.core.errors",
    "APIConnectionError": "eagle3.client.errors",
    "APIError": "eagle3.client.errors",
    "APIStatusError": "eagle3.client.errors",
    "APITimeoutError": "eagle3.client.errors",
    "AuthenticationError": "eagle3.client.errors",
    "BadRequestError": "eagle3.client.errors",
    "InternalServerError": "eagle3.client.errors",
    "InvalidSampleError": "eagle3.client.errors",
    "NoServerAvailableError": "eagle3.client.errors",
    "PayloadTooLargeError": "eagle3.client.errors",
    "RateLimitError": "eagle3.client.errors",
    "SampleFailedError": "eagle3.client.errors",
    "ServiceUnavailableError": "eagle3.client.errors",
    "StreamError": "eagle3.client.errors",
    "train_from_servers": "eagle3.train",
}

if TYPE_CHECKING:
    from eagle3.client.async_sdk import AsyncExtractionClient
    from eagle3.client.errors import (
        APIConnectionError,
        APIError,
        APIStatusError,
        APITimeoutError,
        AuthenticationError,
        BadRequestError,
        InternalServerError,
        InvalidSampleError,
        NoServerAvailableError,
        PayloadTooLargeError,
        RateLimitError,
        SampleFailedError,
        ServiceUnavailableError,
        StreamError,
    )
    from eagle3.client.extract import ExtractConfig, extract_dataset
    from eagle3.client.prepare import PrepareConfig, prepare_dataset
    from eagle3.client.sdk import ExtractionClient
    from eagle3.core.errors import (
        Eagle3Error,
        FeaturesLockedError,
        FeaturesWriteError,
        IncompatibleError,
        InsufficientDiskError,
    )
    from eagle3.core.features_dataset import FeaturesDataset
    from eagle3.core.features_reader import FeaturesReader
    from eagle3.core.sample import ExtractedSample
    from eagle3.train import train_from_servers

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncExtractionClient",
    "AuthenticationError",
    "BadRequestError",
    "Eagle3Error",
    "ExtractConfig",
    "ExtractedSample",
    "ExtractionClient",
    "FeaturesDataset",
    "FeaturesLockedError",
    "FeaturesReader",
    "FeaturesWriteError",
    "IncompatibleError",
    "InsufficientDiskError",
    "InternalServerError",
    "InvalidSampleError",
    "NoServerAvailableError",
    "PayloadTooLargeError",
    "PrepareConfig",
    "RateLimitError",
    "SampleFailedError",
    "ServiceUnavailableError",
    "StreamError",
    "extract_dataset",
    "prepare_dataset",
    "train_from_servers",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
