"""``eagle3 eval`` on the README's own pipeline (issue 30 item 2): when the whole prepared set was
extracted, eval stops before loading any model and names ``--heldout-fraction``; with it, the messages say
what the held-out split holds (never "outside the held-out split")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eagle3.cli import main
from eagle3.draft_trainer import evaluate
from eagle3.draft_trainer.errors import DataError
from tests.trainer_helpers import random_samples, tiny_llama_dir, write_features, write_prepared

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def readme_pipeline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A prepared set and features of *all* of it, as the README's extract line writes them."""
    root = tmp_path_factory.mktemp("eval-prompts")
    model = tiny_llama_dir(root / "model", seed=2)
    prepared = write_prepared(random_samples(40, 97, seed=3), root / "prepared", model, 97)
    other = write_prepared(random_samples(10, 97, seed=9), root / "other", model, 97)
    return {
        "model": model,
        "prepared": prepared,
        "other": other,
        "features": write_features(prepared, root / "features", model),
    }


@pytest.fixture
def no_model_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Any verifier, draft or export load fails the test: the prompt check must come first."""
    loads: list[str] = []

    def refuse(what: str) -> Any:
        def load(*_args: object, **_kwargs: object) -> None:
            loads.append(what)
            raise AssertionError(f"{what} loaded before the prompts were checked")

        return load

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse("the verifier"))
    monkeypatch.setattr(evaluate, "load_verifier_tensors", refuse("the verifier's tensors"))
    monkeypatch.setattr(evaluate, "load_export_draft", refuse("the export"))
    return loads


@pytest.mark.parametrize("engine", ["eagle3", "vllm"])
def test_readme_eval_line_says_to_pass_heldout_fraction_before_loading(
    readme_pipeline: dict[str, Path], no_model_loads: list[str], engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    p = readme_pipeline
    args = [
        "eval",
        str(p["prepared"].parent / "export"),
        "--prepared",
        str(p["prepared"]),
        "--features",
        str(p["features"]),
        "--model",
        str(p["model"]),
        "--engine",
        engine,
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "every prompt was trained on" in err and "pass --heldout-fraction 0.05" in err, err
    assert no_model_loads == []


def test_with_heldout_fraction_the_split_is_used_and_the_messages_read_forwards(
    readme_pipeline: dict[str, Path], no_model_loads: list[str]
) -> None:
    p = readme_pipeline
    prompts = evaluate.heldout_prompts(p["prepared"], p["features"], 100, heldout_fraction=0.3)
    assert 0 < len(prompts) < 40  # the held-out split's prompts, not all of them
    with pytest.raises(DataError, match=r"held-out split .* is empty \(40 samples, none held out\): pass") as err:
        evaluate.heldout_prompts(p["prepared"], p["features"], 5, heldout_fraction=1e-9)
    assert "outside the held-out" not in str(err.value)
    with pytest.raises(DataError, match="give the --prepared directory the features were extracted from"):
        evaluate.heldout_prompts(p["other"], p["features"], 5, heldout_fraction=0.3)
    with pytest.raises(DataError, match="every prompt was trained on"):
        evaluate.evaluate(
            p["prepared"].parent / "export", prepared=p["prepared"], features=p["features"], model=str(p["model"])
        )
    assert no_model_loads == []
