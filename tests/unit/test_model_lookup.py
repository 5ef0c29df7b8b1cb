"""``--model org/name`` resolves from the local Hugging Face cache without any network; absent, the
error says how to fetch it."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.core.models import ModelNotFoundError, resolve_model_dir


def test_org_name_from_the_local_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any network access would fail the lookup
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolve_model_dir("acme/tiny-llama") == snapshot
    assert resolve_model_dir(f"acme/tiny-llama@{'a' * 40}") == snapshot
    with pytest.raises(ModelNotFoundError, match="huggingface-cli download"):
        resolve_model_dir("acme/not-cached")
