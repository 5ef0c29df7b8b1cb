"""Limits the server enforces before its 200 and the SDK checks before sending (one definition).

Every string a request carries comes back in some frame's meta (sample ids in DATA, SAMPLE_ERROR and
the ERROR frame's ``completed_sample_ids``), and a frame's meta is at most ``MAX_META_BYTES``. So ids
are bounded in their JSON form (``json.dumps``: escapes count), each and per request, with room to
spare for the rest of the meta: a request the server accepted can always be answered.
"""

from __future__ import annotations

import json

from eagle3.core.protocol.frames import MAX_META_BYTES

MAX_SAMPLE_ID_BYTES = 1024  # one sample id, as JSON
MAX_REQUEST_ID_BYTES = MAX_META_BYTES // 4  # all sample ids of one request, as JSON (256 KiB)


def sample_id_bytes(sample_id: str) -> int:
    """The id's size in a frame's meta (JSON, ASCII-escaped as the server writes it)."""
    return len(json.dumps(sample_id))


def sample_id_problem(sample_id: str) -> str | None:
    """Why this id cannot be sent, or None."""
    if not sample_id:
        return "sample id is empty"
    n_bytes = sample_id_bytes(sample_id)
    if n_bytes > MAX_SAMPLE_ID_BYTES:
        return f"sample id is {n_bytes} bytes as JSON, over the {MAX_SAMPLE_ID_BYTES}-byte limit; use a shorter id"
    return None
