"""What a notebook passes to ``ExtractionClient`` -> ``/v1/extract`` sample objects (validated, no I/O).

A sample is a list of token ids, a list of chat messages, an ``{"id", "input_ids", "loss_mask"?}`` or
``{"id", "messages"}`` dict, or a ``PreparedSample``. Ids default to the sample's position; every id is
checked (``sample_id_problem``) and must be unique within one call. Token ids sent without a mask get
``DEFAULT_LOSS_MASK`` for every token, explicitly on the wire, and the first such sample of the process
raises ``MaskMissingWarning`` once (features of those samples train on nothing).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from eagle3.client.errors import InvalidSampleError
from eagle3.core.protocol.limits import sample_id_problem
from eagle3.core.protocol.prepared import PreparedSample

# Token ids sent without a loss mask (a bare list, or a dict without "loss_mask") get this mask value
# for every token: 0, "not trained on" (the server's own default too). Send a mask, chat messages (the
# template marks the assistant turns) or PreparedSample to train on a sample's tokens.
DEFAULT_LOSS_MASK = 0
JSON_BYTES_PER_TOKEN = 10  # a request body's size per token id, generously (ids up to 6 digits, separators)
NO_MASK_WARNING = (
    "token ids were sent without a loss_mask: every token gets loss_mask 0 (not trained on), so a draft "
    "trained on these features learns nothing from them. Pass {'input_ids': ..., 'loss_mask': [1, ...]}, "
    "chat messages (the template marks the assistant turns) or PreparedSample (eagle3 prepare). "
    "Said once per process."
)
_warned_no_mask = False


class MaskMissingWarning(UserWarning):
    """Token ids sent without a loss mask: their features carry loss_mask 0 everywhere (warned once)."""


def _warn_no_mask() -> None:
    global _warned_no_mask
    if not _warned_no_mask:
        _warned_no_mask = True
        warnings.warn(NO_MASK_WARNING, MaskMissingWarning, stacklevel=5)  # the notebook's extract() line


T = TypeVar("T")

Sample = Any  # list[int] | {"input_ids", "loss_mask"?, "id"?} | {"messages", "id"?} | list[message] | PreparedSample


def to_request_samples(samples: Iterable[Sample]) -> list[dict[str, Any]]:
    """Normalize what a notebook passes into ``/v1/extract`` sample objects; ids default to positions."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for index, sample in enumerate(samples):
        req = _request_sample(sample, index)
        if (problem := sample_id_problem(req["id"])) is not None:
            raise InvalidSampleError(f"sample {index}: {problem}")
        if req["id"] in seen:
            raise InvalidSampleError(f"sample {index}: duplicate sample id {req['id']!r}")
        seen.add(req["id"])
        out.append(req)
    return out


def request_tokens(req: dict[str, Any]) -> int:
    """Tokens a request sample counts for when cutting requests: its ids, or for chat messages the
    characters of their text (an upper bound of the tokens for every BPE vocabulary in practice)."""
    if "input_ids" in req:
        return len(req["input_ids"])
    return sum(len(str(m.get("content", ""))) + 8 for m in req["messages"])


def _request_sample(sample: Sample, index: int) -> dict[str, Any]:
    if isinstance(sample, PreparedSample):
        return {"id": sample.sample_id, "input_ids": list(sample.input_ids), "loss_mask": list(sample.loss_mask)}
    if hasattr(sample, "tolist"):  # numpy array of token ids
        sample = sample.tolist()
    if isinstance(sample, Mapping):
        sample_id = str(sample.get("id", index))
        if not sample_id:
            raise InvalidSampleError(f"sample {index}: empty sample id")
        if "input_ids" in sample:
            req = {"id": sample_id, "input_ids": _token_ids(sample["input_ids"], index, "input_ids")}
            req["loss_mask"] = [DEFAULT_LOSS_MASK] * len(req["input_ids"])  # explicit on the wire
            if sample.get("loss_mask") is not None:
                req["loss_mask"] = _token_ids(sample["loss_mask"], index, "loss_mask")
                if len(req["loss_mask"]) != len(req["input_ids"]):
                    raise InvalidSampleError(f"sample {sample_id!r}: loss_mask and input_ids differ in length")
            else:
                _warn_no_mask()
            return req
        if "messages" in sample:
            return {"id": sample_id, "messages": _messages(sample["messages"], index)}
        raise InvalidSampleError(f"sample {index}: a dict sample needs 'input_ids' or 'messages'")
    if isinstance(sample, (list, tuple)) and sample and all(isinstance(m, Mapping) for m in sample):
        return {"id": str(index), "messages": _messages(sample, index)}
    if isinstance(sample, (list, tuple)):
        ids = _token_ids(sample, index, "input_ids")
        _warn_no_mask()
        return {"id": str(index), "input_ids": ids, "loss_mask": [DEFAULT_LOSS_MASK] * len(ids)}  # explicit
    raise InvalidSampleError(
        f"sample {index}: expected token ids, chat messages or a dict, got {type(sample).__name__}"
    )


def _token_ids(values: Any, index: int, name: str) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or not values:
        raise InvalidSampleError(f"sample {index}: {name} must be a non-empty list of integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise InvalidSampleError(f"sample {index}: {name} must hold integers only")
    return list(values)


def _messages(messages: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidSampleError(f"sample {index}: messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise InvalidSampleError(f"sample {index}: every message needs 'role' and 'content'")
    return [dict(m) for m in messages]


def request_token_cap(max_request_tokens: int, max_body_bytes: int) -> int:
    """Tokens one ``/v1/extract`` request may carry under both server limits (``JSON_BYTES_PER_TOKEN`` of
    body per token)."""
    return min(max_request_tokens, max_body_bytes // JSON_BYTES_PER_TOKEN)


def consecutive_runs(items: Iterable[T], cost: Callable[[T], int], max_cost: int) -> Iterator[list[T]]:
    """``items`` cut, in order, into consecutive runs whose costs add up to at most ``max_cost``; an item
    that alone costs more goes in a run of its own (the server's 400 then names it). The one request cut
    of the SDK, ``extract_dataset`` and ``distill_dataset``."""
    run: list[T] = []
    total = 0
    for item in items:
        item_cost = cost(item)
        if run and total + item_cost > max_cost:
            yield run
            run, total = [], 0
        run.append(item)
        total += item_cost
    if run:
        yield run
