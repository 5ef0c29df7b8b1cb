"""Chat ``messages`` input is bounded before it is rendered (server/chat_limits.py): a conversation of
thousands of turns, or of more characters than ``max_model_len`` tokens can spell, is a 400 without
one template render; one within the bounds is still served. Real SmolLM2 tokenizer and template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from eagle3.core.masking import ChatTokenizer
from eagle3.server.app import create_app
from eagle3.server.backends import BackendInfo
from eagle3.server.chat_limits import chat_limits, longest_token_chars, min_tokens_per_message
from tests.unit.test_server_app import FakeBackend, settings, wait_for


class ChatBackend(FakeBackend):
    """The fake engine with SmolLM2's vocabulary size (its model dir holds SmolLM2's tokenizer)."""

    def load(self, progress: object) -> BackendInfo:
        info = super().load(progress)
        return BackendInfo(**{**info.__dict__, "vocab_size": 49152})


def pairs(n: int, text: str = "hi") -> list[dict[str, str]]:
    return [m for _ in range(n) for m in ({"role": "user", "content": text}, {"role": "assistant", "content": text})]


@pytest.fixture(scope="module")
def served(smollm2_dir: Path) -> Any:
    with TestClient(create_app(settings(max_request_tokens=4096), ChatBackend(smollm2_dir))) as client:
        wait_for(client, "ready")
        rt = client.app.state.runtime  # type: ignore[attr-defined]
        renders: list[int] = []
        render = rt.chat.render

        def counting_render(*args: Any, **kwargs: Any) -> str:
            renders.append(1)
            return str(render(*args, **kwargs))

        rt.chat.render = counting_render
        yield client, rt, renders


def test_limits_follow_the_template_and_the_vocabulary(smollm2_tokenizer: Any) -> None:
    chat = ChatTokenizer(smollm2_tokenizer)
    longest, per_message = longest_token_chars(chat), min_tokens_per_message(chat)
    assert 8 <= longest <= 256 and 1 <= per_message <= 8, (longest, per_message)
    limits = chat_limits(chat, 512)
    assert limits.max_messages == 512 // per_message and limits.max_chars == 512 * longest


def test_too_many_turns_is_a_400_before_any_render(served: Any) -> None:
    client, rt, renders = served
    renders.clear()
    resp = client.post("/v1/extract", json={"samples": [{"id": "a", "messages": pairs(1600)}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "samples[0].messages", resp.text
    assert f"at most {rt.chat_limits.max_messages}" in resp.json()["error"]["message"]
    assert renders == []


def test_too_many_characters_is_a_400_before_any_render(served: Any) -> None:
    client, rt, renders = served
    renders.clear()
    text = "x" * (rt.chat_limits.max_chars // 2 + 1)
    resp = client.post("/v1/extract", json={"samples": [{"id": "a", "messages": pairs(1, text)}]})
    assert resp.status_code == 400 and "characters" in resp.json()["error"]["message"], resp.text
    assert renders == []
    per_sample = rt.chat_limits.max_chars // 4  # each fits, all together pass the request's character cap
    n_samples = rt.chat_limits.request_chars(rt.settings.request_token_cap) // (per_sample - 100) + 2
    many = [{"id": str(i), "messages": pairs(1, "y" * (per_sample // 2 - 20))} for i in range(n_samples)]
    resp = client.post("/v1/extract", json={"samples": many})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "samples", resp.text
    assert renders == []


def test_a_conversation_over_max_model_len_costs_one_render_not_one_per_turn(served: Any) -> None:
    client, rt, renders = served
    renders.clear()
    n_pairs = rt.chat_limits.max_messages // 2  # within the message bound, ~13 tokens a pair: over 512
    resp = client.post("/v1/extract", json={"samples": [{"id": "a", "messages": pairs(n_pairs)}]})
    assert resp.status_code == 400 and "over max_model_len 512" in resp.json()["error"]["message"], resp.text
    assert len(renders) == 1  # was 1 + 2 per assistant turn before the count came first


def test_a_conversation_within_the_bounds_is_served(served: Any) -> None:
    client, rt, renders = served
    renders.clear()
    resp = client.post("/v1/extract", json={"samples": [{"id": "a", "messages": pairs(3)}]})
    assert resp.status_code == 200 and len(renders) == 2 + 3 * 2  # counted, the whole, then 2 per assistant turn
