"""Self-instruct over HTTP: user prompts sampled from the resident verifier (Magpie-style), steered by
opening words, stored as a prepared directory for ``eagle3 distill``.

    texts = sample_prompts(client, tokenizer, SelfInstructConfig(n_prompts=800), exclude=eval_turns,
                           openers=first_words_of_training_prompts)
    write_prompt_dir(texts, "si-prompts", tokenizer, read_meta("prepared"))

The verifier gets the chat template's user-turn prefix (SmolLM2's default system turn, then
``<|im_start|>user\\n``; DeepSeek-V3's ``<｜begin▁of▁sentence｜><｜User｜>``) and writes the user's turn,
sampled (temperature, top-p, seeded per request) through ``POST /v1/generate`` until the token that ends a
user turn (``<|im_end|>``, ``<｜Assistant｜>``): the markers are read from the template itself
(``client/chat_turns.py``), so any template works or is refused before a request. The verifier is loaded
once, by the server, as for distill and extract. Kept prompts are complete (the turn ended within ``max_tokens``),
``min_tokens..max_tokens`` content tokens long, not degenerate (at least half their tokens distinct,
some letters) and distinct after normalisation (case, punctuation, whitespace) from each other and from
``exclude`` (e.g. every evaluation prompt).

Steering (``openers``): unsteered, a small verifier writes long, formulaic turns ("Can..." and "I'm..."
started 65 % of SmolLM2's, docs/draft-quality.md). Given opening words (e.g. the first word of every training
prompt of a dataset, so frequent openers come up often), each sequence starts with one drawn at random
(seeded) and the verifier writes the rest: the prompts follow the dataset's mix of question types
(trivia "Which...", chat "Do you...", code "can you write...") in the verifier's own words.

Other openers (``load_openers``): a file (one per line, repeats weigh), or ``task`` (``TASK_OPENERS``:
instruction verbs and question stems, for prompts unlike a chat dataset's). A second set of prompts for
the same dataset takes another ``id_prefix`` so its ids do not collide with the first.

No kept prompt overlaps an evaluation prompt set (``core.prompt_sets.overlapping_prompts``: MT-Bench's
first turns), so a draft trained on them is never scored on what it was trained on.

Invariants (tests/integration/test_self_instruct.py): the same server, config, openers and exclusions
give the same prompts, so a rerun into the same directory with the same server, input and settings reuses
the prompts written there (``STATE_FILE``, written after them) without a request; every steered prompt
starts with one of the openers; a prompt's stored ids are the chat template's rendering with the
generation prompt (what ``eagle3 prepare`` produces for that turn).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# the dedupe key and the one-user-turn render are the benchmark prompt sets' (core/prompt_sets.py)
from eagle3.client.chat_turns import UserTurnMarkers, user_turn_markers
from eagle3.core.atomic_write import write_text_atomic
from eagle3.core.errors import Eagle3Error
from eagle3.core.prompt_sets import mt_bench_first_turns, normalize, overlapping_prompts
from eagle3.core.prompt_sets import render_user_prompt as render_prompt
from eagle3.core.protocol.prepared import (
    SAMPLES_FILE,
    PreparedMeta,
    PreparedSample,
    is_heldout,
    iter_prepared,
    read_meta,
    variant_of,
    write_prepared,
)

if TYPE_CHECKING:
    from eagle3.client.sdk import ExtractionClient

STATE_FILE = "self-instruct.json"  # beside finished prompts: what made them (run_state); a rerun reuses them
SEED_STRIDE = 100_003  # request r of seed s samples with seed s * SEED_STRIDE + r
DATASET_OPENERS = "dataset"  # ``load_openers``: the first words of the dataset's training prompts
# ``load_openers("task")``: general instruction openers (verbs and question stems of everyday requests:
# writing, explaining, listing, code, planning), chosen without looking at any evaluation set; what the
# verifier writes after them is checked against MT-Bench (``overlapping_prompts``)
TASK_OPENERS = (
    "Write", "Write a short", "Write a Python function", "Explain", "Explain why", "Describe", "Give me",
    "List", "Summarize", "Create", "Generate", "Suggest", "Compare", "How do I", "How does", "Why is",
    "What are the", "Can you explain", "Help me", "Tell me about", "Classify", "Rewrite", "Translate",
    "Solve", "Calculate", "Design", "Plan", "Brainstorm", "Provide", "Outline",
)  # fmt: skip


@dataclass(frozen=True)
class SelfInstructConfig:
    n_prompts: int = 64
    prompts_per_request: int = 64  # sequences sampled per generate request
    max_requests: int = 0  # 0: up to 4 * n_prompts / prompts_per_request + 1
    temperature: float = 1.0
    top_p: float = 0.95
    min_tokens: int = 4  # content tokens of a kept prompt (the opener included, the end token not)
    max_tokens: int = 40
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_prompts < 1 or self.prompts_per_request < 1 or self.max_requests < 0:
            raise ValueError("n_prompts and prompts_per_request must be >= 1 and max_requests >= 0")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens} and {self.max_tokens}")
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError("self-instruct samples: temperature must be > 0 and top_p in (0, 1]")


def is_acceptable(content_ids: list[int], text: str, min_tokens: int, max_tokens: int) -> bool:
    """Length in range, >= half the tokens distinct (no degenerate repeats), and some letters."""
    n_tokens = len(content_ids)
    if not min_tokens <= n_tokens <= max_tokens:
        return False
    return 2 * len(set(content_ids)) >= n_tokens and re.search(r"[A-Za-z]{2}", text) is not None


def user_turns(tokenizer: Any, prompt_ids: Sequence[int], markers: UserTurnMarkers | None = None) -> list[str]:
    """The user turns of a rendered prompt, in order (the texts ``sample_prompts`` excludes or takes
    openers from); ``markers`` are the tokenizer's template's (``user_turn_markers``)."""
    markers = markers or user_turn_markers(tokenizer, "the verifier")
    return markers.user_turns(str(tokenizer.decode(list(prompt_ids))))


def openers_and_turns(
    tokenizer: Any, prepared_dir: str | Path, heldout_fraction: float, markers: UserTurnMarkers | None = None
) -> tuple[list[str], list[str]]:
    """Openers (the first word of each training-split prompt's last user turn, one per prompt, so frequent
    ones weigh: held-out prompts lend nothing) and every user turn of the dataset, held out or not (what
    ``sample_prompts`` must exclude so no new prompt equals an eval prompt). Extra replies are skipped."""
    openers: list[str] = []
    dataset_turns: list[str] = []
    markers = markers or user_turn_markers(tokenizer, "the verifier")
    for sample in iter_prepared(prepared_dir):
        if variant_of(sample.sample_id)[1]:
            continue  # a sampled reply repeats its prompt
        turns = user_turns(tokenizer, sample.input_ids[: sample.loss_mask.index(1)], markers)
        dataset_turns += turns
        if turns and turns[-1].split() and not is_heldout(sample.sample_id, heldout_fraction):
            openers.append(turns[-1].split()[0])
    return openers, dataset_turns


def trains_as(id_suffix: str, heldout_fraction: float) -> Callable[[str], bool]:
    """``write_prompt_dir``'s ``id_ok`` keeping only ids whose answers (``<id><id_suffix>``, e.g.
    ``-distill``) the held-out split of ``heldout_fraction`` trains on."""
    return lambda sample_id: not is_heldout(sample_id + id_suffix, heldout_fraction)


class OpenersError(Eagle3Error, ValueError):
    """An openers file that cannot steer: unreadable, or no opener in it."""


def load_openers(spec: str) -> list[str] | None:
    """``DATASET_OPENERS`` (None: the dataset's own first words), ``task`` (``TASK_OPENERS``) or a UTF-8
    file with one opener per line (blank lines and ``#`` comments skipped; repeat a line to weigh it)."""
    if spec == DATASET_OPENERS:
        return None
    if spec == "task":
        return list(TASK_OPENERS)
    try:
        lines = Path(spec).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise OpenersError(f"--openers {spec}: not {DATASET_OPENERS!r}, 'task' or a readable UTF-8 file ({e})") from e
    openers = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not openers:
        raise OpenersError(f"{spec}: no opener (one per line; blank lines and # comments are skipped)")
    return openers


def sample_prompts(
    client: ExtractionClient,
    tokenizer: Any,
    config: SelfInstructConfig,
    exclude: Iterable[str] = (),
    openers: Sequence[str] = (),
    markers: UserTurnMarkers | None = None,
) -> list[str]:
    """Up to ``config.n_prompts`` distinct user prompts written by the verifier ``client`` serves.

    With ``openers``, each sequence's turn starts with one of them (drawn uniformly: repeats weigh). None
    equals an ``exclude`` text or overlaps an MT-Bench question (``overlapping_prompts``).
    ``tokenizer`` is the verifier's (the server's ``tokenizer_sha256``); ``markers`` its template's
    (``user_turn_markers``: read here when not given)."""
    cfg = config
    markers = markers or user_turn_markers(tokenizer, "the verifier")
    end_id = markers.end_id
    prefix = list(tokenizer(markers.prefix, add_special_tokens=False)["input_ids"])
    opener_ids = [list(tokenizer(o, add_special_tokens=False)["input_ids"]) for o in openers if o.strip()]
    seen = {normalize(t) for t in exclude}
    bench = mt_bench_first_turns()  # read once: every candidate is checked against it
    kept: list[str] = []
    max_requests = cfg.max_requests or 4 * cfg.n_prompts // cfg.prompts_per_request + 1
    for request_no in range(max_requests):
        seed = cfg.seed * SEED_STRIDE + request_no
        draw = random.Random(seed)  # noqa: S311 (a reproducible draw, not a secret)
        starts = [draw.choice(opener_ids) if opener_ids else [] for _ in range(cfg.prompts_per_request)]
        answer = client.generate(
            [prefix + s for s in starts],
            max_new_tokens=cfg.max_tokens + 1,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=seed,
            stop_token_ids=[end_id],
        )
        for start, reply in zip(starts, answer.replies, strict=True):
            if reply.finish_reason != "stop":
                continue  # ran past max_tokens: incomplete
            content = start + list(reply.output_ids[:-1])
            text = str(tokenizer.decode(content)).strip()
            key = normalize(text)
            if not key or key in seen or not is_acceptable(content, text, cfg.min_tokens, cfg.max_tokens):
                continue
            seen.add(key)
            if not overlapping_prompts([text], bench):
                kept.append(text)
        if len(kept) >= cfg.n_prompts:
            break
    return kept[: cfg.n_prompts]


def diversity_stats(texts: list[str], tokenizer: Any) -> dict[str, float]:
    """Prompt-diversity figures: count, mean content tokens, distinct-1/-2 (distinct n-grams / n-grams)."""
    token_rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    unigrams = [tok for row in token_rows for tok in row]
    bigrams = [tuple(row[i : i + 2]) for row in token_rows for i in range(len(row) - 1)]
    first_words = {t.split()[0].lower() for t in texts if t.split()}
    return {
        "n_prompts": len(texts),
        "mean_tokens": round(len(unigrams) / max(1, len(texts)), 2),
        "distinct_tokens": len(set(unigrams)),
        "distinct_1": round(len(set(unigrams)) / max(1, len(unigrams)), 4),
        "distinct_2": round(len(set(bigrams)) / max(1, len(bigrams)), 4),
        "distinct_first_words": len(first_words),
    }


def write_prompt_dir(
    texts: list[str],
    out_dir: str | Path,
    tokenizer: Any,
    meta: PreparedMeta,
    id_ok: Callable[[str], bool] = lambda _: True,
    id_prefix: str = "si",
    markers: UserTurnMarkers | None = None,
    source: str = "self-instruct",
) -> Path:
    """A prepared directory of ``texts`` with one placeholder supervised token (the template's user-turn end,
    ``UserTurnMarkers.end_id``) each, so
    ``eagle3 distill`` answers them. Ids are ``<id_prefix>-00000``, ``<id_prefix>-00001``... skipping any
    ``id_ok`` rejects (the demo skips ids its held-out hash would take, so none of these prompts is held out)."""
    end_id = (markers or user_turn_markers(tokenizer, meta.model)).end_id
    numbers = (n for n in itertools.count() if id_ok(f"{id_prefix}-{n:05d}"))

    def samples() -> Iterable[PreparedSample]:
        for text, number in zip(texts, numbers, strict=False):
            prompt = render_prompt(tokenizer, text)
            yield PreparedSample(f"{id_prefix}-{number:05d}", [*prompt, end_id], [0] * len(prompt) + [1], source=text)

    stats = {"source": source, **diversity_stats(texts, tokenizer)}
    write_prepared(out_dir, samples(), dataclasses.replace(meta, inputs=[source]), stats)
    return Path(out_dir)


@dataclass(frozen=True)
class SelfInstructResult:
    texts: list[str]  # the kept prompts, in id order
    n_openers: int  # distinct openers that steered them (0: unsteered)
    reused: bool = False  # out_dir held this run's prompts already: no request was made


def run_state(
    info: Any,
    prepared_dir: Path,
    config: SelfInstructConfig,
    heldout_fraction: float,
    steer: bool,
    openers: Sequence[str] | None = None,
    id_prefix: str = "si",
) -> dict[str, Any]:
    """What decides the prompts (the same server, input, settings give the same prompts): recorded in
    ``STATE_FILE`` beside them. The input is named by its path and its samples file's size and mtime (a
    re-distilled input gets a new mtime, so its prompts are sampled again; a resumed one keeps its file)."""
    from eagle3.client.distill import server_identity

    samples = (prepared_dir / SAMPLES_FILE).stat()
    return {
        "prepared": str(prepared_dir.resolve()),
        "prepared_samples": {"bytes": samples.st_size, "mtime_ns": samples.st_mtime_ns},
        "server": server_identity(info),
        "settings": {**dataclasses.asdict(config), "steer": steer, "heldout_fraction": heldout_fraction},
        **({} if openers is None else {"openers": list(openers)}),
        **({} if id_prefix == "si" else {"id_prefix": id_prefix}),
    }


def _recorded_state(out: Path) -> Any:
    """The state a finished run recorded, or None (none, or unreadable: then the prompts are sampled again)."""
    try:
        return json.loads((out / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def self_instruct(
    client: ExtractionClient,
    prepared_dir: str | Path,
    out_dir: str | Path,
    config: SelfInstructConfig,
    heldout_fraction: float,
    *,
    steer: bool = True,
    openers: Sequence[str] | None = None,
    id_prefix: str = "si",
) -> SelfInstructResult:
    """``eagle3 self-instruct`` and ``eagle3 demo --self-instruct``: prompts for the dataset at
    ``prepared_dir`` (the directory that is trained on: its ids decide the held-out split) written to
    ``out_dir``. Refused before any request where the server cannot generate for its tokenizer
    (``check_can_generate_for``); reused where ``out_dir`` holds this run's prompts (``run_state``); steered
    by the first words of its training-split prompts
    (``openers_and_turns``) unless ``openers`` are given (``load_openers``), none equal to any of its
    prompts, and only ids (``<id_prefix>-NNNNN``) whose distilled answers train (``trains_as``), so the
    held-out split stays the dataset's own."""
    from eagle3.client.distill import ID_SUFFIX, check_can_generate_for
    from eagle3.client.prepare import load_tokenizer

    meta = read_meta(prepared_dir)
    info = client.info()
    check_can_generate_for(info, meta, Path(prepared_dir))
    tokenizer = load_tokenizer(Path(meta.model_dir))
    markers = user_turn_markers(tokenizer, meta.model)  # a template it cannot read: refused before any request
    dataset_openers, dataset_turns = openers_and_turns(tokenizer, prepared_dir, heldout_fraction, markers)
    steering = (dataset_openers if openers is None else list(openers)) if steer else []
    out = Path(out_dir)
    state = run_state(info, Path(prepared_dir), config, heldout_fraction, steer, openers, id_prefix)
    if (out / SAMPLES_FILE).is_file() and _recorded_state(out) == state:  # a rerun: the same prompts, written
        return SelfInstructResult([s.source for s in iter_prepared(out)], len(set(steering)), reused=True)
    (out / STATE_FILE).unlink(missing_ok=True)  # written last: present only beside finished prompts
    texts = sample_prompts(client, tokenizer, config, exclude=dataset_turns, openers=steering, markers=markers)
    id_ok = trains_as(ID_SUFFIX, heldout_fraction)
    write_prompt_dir(texts, out, tokenizer, meta, id_ok=id_ok, id_prefix=id_prefix, markers=markers)
    write_text_atomic(out / STATE_FILE, json.dumps(state, indent=2) + "\n")
    return SelfInstructResult(texts, len(set(steering)))
