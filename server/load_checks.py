"""What the server checks around loading a model: whether a load failure is a configuration error (``serve``
exits 2, docs/reliability.md) or one a restart may cure, and the tokenizer checks before the backend loads
(a tokenizer must round-trip text, core/tokenizer_probe.py; the chat template for ``messages`` requests).
"""

from __future__ import annotations

import logging

from eagle3.core.cli_args import MissingModelError
from eagle3.core.engine_args import EngineArgsError
from eagle3.core.knobs import KnobError
from eagle3.core.masking import ChatTokenizer
from eagle3.core.models import ModelNotFoundError
from eagle3.core.tokenizer_probe import TokenizerProbeError, probe_tokenizer
from eagle3.server.backends import BackendConfigError

logger = logging.getLogger(__name__)

# Load failures that the same settings reproduce on every start: a bad flag, variable or config entry,
# an unknown or reserved --engine-arg, a --model that names nothing, a setting the backend cannot load, a
# package the backend needs and this environment lacks.
CONFIGURATION_ERRORS = (
    KnobError,
    EngineArgsError,
    ModelNotFoundError,
    MissingModelError,
    BackendConfigError,
    TokenizerProbeError,
    ModuleNotFoundError,
)


def retry_could_cure(exc: BaseException) -> bool:
    """False for a configuration error; True for everything else (an engine that ran out of memory, a
    download or a disk that failed, a bug: a restart may get past them)."""
    return not isinstance(exc, CONFIGURATION_ERRORS)


def check_tokenizer(model: str, trust_remote_code: bool = False) -> None:
    """``TokenizerProbeError`` when the model's tokenizer loads but loses text on a round trip (DeepSeek-V3's
    files beside another config type, core/tokenizer_probe.py); a model without a loadable tokenizer passes
    (it is served with ``input_ids`` only, ``load_chat_tokenizer``)."""
    from transformers import AutoTokenizer

    from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir
    from eagle3.server.backends.dummy_model import is_dummy

    model_dir = resolve_model_dir(DEFAULT_MODEL if is_dummy(model) else model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 (no tokenizer: nothing to probe)
        return
    probe_tokenizer(tokenizer, model_dir)


def load_chat_tokenizer(model_dir: str, trust_remote_code: bool = False) -> ChatTokenizer | None:
    """The model's tokenizer with its chat template, or None (then only ``input_ids`` are accepted)."""
    from transformers import AutoTokenizer

    try:
        return ChatTokenizer(AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code))
    except Exception as exc:  # noqa: BLE001 (any tokenizer failure means: no chat template)
        logger.warning("no chat tokenizer for %s (%s): requests must send input_ids", model_dir, exc)
        return None
