"""vLLM engine arguments given on a command line: ``--engine-arg KEY=VALUE`` (repeatable) and
``--engine-args-json '{...}'``, shared by ``eagle3 serve --backend vllm`` and ``eagle3 eval --engine vllm``.

Stdlib only: parsing and the unknown-field message live here; the set of valid names comes from the
installed vLLM's ``EngineArgs`` dataclass, which only the callers that import vLLM can read.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Sequence
from typing import Any

from eagle3.core.errors import Eagle3Error


class EngineArgsError(Eagle3Error, ValueError):
    """A pass-through engine argument is malformed, unknown to this vLLM, or owned by eagle3."""


def parse_engine_args(items: Sequence[str], json_text: str | None = None) -> dict[str, Any]:
    """``KEY=VALUE`` items (VALUE parsed as JSON, else kept as a string) over a JSON object; the items
    win over the object. Dashes in keys become underscores (``enable-expert-parallel``)."""
    args: dict[str, Any] = {}
    if json_text:
        try:
            parsed = json.loads(json_text)
        except json.JSONDecodeError as exc:
            raise EngineArgsError(f"--engine-args-json: not valid JSON ({exc.msg})") from None
        if not isinstance(parsed, dict):
            raise EngineArgsError("--engine-args-json: expected a JSON object {field: value}")
        args.update({str(k).replace("-", "_"): v for k, v in parsed.items()})
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise EngineArgsError(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. enable_expert_parallel=true")
        try:
            args[key.strip().replace("-", "_")] = json.loads(text)
        except json.JSONDecodeError:
            args[key.strip().replace("-", "_")] = text  # a bare string such as a quantization name
    return args


def check_engine_args(args: dict[str, Any], known_fields: Iterable[str], owned: Iterable[str] = ()) -> None:
    """Raise ``EngineArgsError`` naming each key that eagle3 sets itself (``owned``) or that this
    vLLM's ``EngineArgs`` does not have (with the closest valid name)."""
    taken = sorted(set(args) & set(owned))
    if taken:
        raise EngineArgsError(f"--engine-arg {taken}: set by eagle3 itself and cannot be overridden")
    known = sorted(set(known_fields))
    unknown = sorted(set(args) - set(known))
    if unknown:
        close = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        hints = ", ".join(f"{k!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for k, c in close.items())
        raise EngineArgsError(f"--engine-arg: unknown vLLM EngineArgs field(s) {hints}")
