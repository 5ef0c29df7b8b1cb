"""Which model's states these are: the one identity every component compares (stdlib only).

A server describes itself with it (``/v1/info``, each stream's HEADER), a features directory records
it (``features.json``), and the SDK refuses to mix two: a features directory resumed with another
server, a stream whose HEADER differs from the ``/v1/info`` it was checked against, a server joining
an extraction that another one started. All of them compare with ``ModelIdentity.diff``, which names
every field that differs.

The wire keeps its flat layout: ``ServerInfo``, ``StreamHeader`` and ``FeaturesMeta`` each carry
these fields by the same names (``identity_fields(obj)`` reads them back, ``as_fields()`` spreads
them into a constructor). A new field (a feature dtype, a rope setting) is added here and to those
three; a place that builds one of them without it fails at once (a missing argument), and every
comparison includes it (tests/unit/test_model_identity.py checks both for every field).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelIdentity:
    model_id: str  # what the server calls its verifier (the checkpoint directory's name)
    revision: str  # the checkpoint's weights by content (core/identity.py::checkpoint_revision)
    aux_layer_ids: tuple[int, ...]  # vLLM semantics; the final state is the extra last layer
    final_layer_id: int  # = number of decoder layers N
    hidden_size: int
    vocab_size: int  # embedding rows: valid token ids are [0, vocab_size)
    tokenizer_sha256: str  # over the tokenizer files (core/identity.py::tokenizer_sha256)

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))

    @classmethod
    def of(cls, obj: Any) -> ModelIdentity:
        """The identity that ``obj`` (a ``ServerInfo``, ``StreamHeader``, ``FeaturesMeta``, a backend's
        info, ...) carries in fields of the same names."""
        return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})

    def as_fields(self) -> dict[str, Any]:
        """The fields by name, to build a wire object: ``StreamHeader(**identity.as_fields(), ...)``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def diff(self, other: ModelIdentity) -> str:
        """'' when equal, else every differing field as ``name: this -> other`` (long hashes shortened)."""
        parts = []
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                parts.append(f"{f.name}: {_show(mine)} -> {_show(theirs)}")
        return ", ".join(parts)


def _show(value: Any) -> str:
    if isinstance(value, str) and len(value) > 24:
        return repr(value[:12] + "...")
    if isinstance(value, tuple):
        return repr(list(value))
    return repr(value)
