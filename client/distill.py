"""``distill_dataset``: a prepared dataset's assistant turns rewritten by the verifier, through a server.

A draft is judged by how often it proposes what the *verifier* says next, so it learns best from the
verifier's own replies. This asks a running ``eagle3 serve`` (``POST /v1/generate``, client/generate.py)
for them: no second load of the verifier anywhere.

Per sample (token level, no re-tokenization): the supervised runs of ``loss_mask`` are the assistant
turns, the runs between them the prompts (user turns, template markup). Turn ``k`` is regenerated from
the new conversation so far plus the original prompt run ``k``; the reply (its end-of-turn token
included) is supervised, followed by whatever the original turn had after its end-of-turn token (the
template's newline: supervised too, as prepare marks it). A reply that ends by ``max_new_tokens`` ends
the sample there; so does a turn whose prompt + ``max_new_tokens`` would not fit the server's context
(a sample with no turn left is dropped and counted). Output ids are ``<id>-distill``; the first
``max_samples`` samples with distinct prompts are used (in file order); ``meta.json`` is the input's
with ``max_length`` updated.

Resumable and deterministic. Samples go in fixed batches of ``prompts_per_request`` (cut from the
selected list, never from what is left), one ``generate`` request per batch and turn (split only by the
server's request-token cap, deterministically), and a reply depends only on its request (the backend
invariant, server/backends/base.py). Each batch's samples are appended to ``samples.jsonl.partial`` and
fsynced; a rerun reads it (a torn last line is cut), regenerates only batches with a missing sample and
writes only the missing ones, in batch order: the finished file equals an uninterrupted run's, with no
duplicate. ``distill.json`` records the input, the server's identity and the settings; a rerun with
others is refused (``--overwrite`` starts again). ``samples.jsonl`` appears only when all is done (after
``meta.json`` and ``stats.json``). Sampled runs (``temperature > 0``) use ``seed`` (default 0) plus the
batch and turn number per request, so they resume deterministically too.

Extra replies (``sampled_replies`` N > 0, ``eagle3 distill --sampled-replies N``): besides its reply at
``temperature`` (id ``<id>-distill``), every prompt gets N replies sampled at ``sampled_temperature``
(ids ``<id>-distill~s1`` ... ``~sN``, core/protocol/prepared.py ``variant_id``), more of the verifier's
own text per prompt. They go in their own requests (one per batch and turn, seeded apart from the
main replies), follow their prompt in the output, and resume like the rest. Training splits them
with their prompt: none of the extra replies to a held-out prompt is trained on
(draft_trainer/data.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.client.errors import IncompatibleError
from eagle3.client.request_samples import consecutive_runs
from eagle3.client.sdk import ExtractionClient
from eagle3.core.protocol.generate import GenerateResponse
from eagle3.core.protocol.prepared import (
    META_FILE,
    SAMPLES_FILE,
    STATS_FILE,
    PreparedFormatError,
    PreparedMeta,
    PreparedSample,
    iter_prepared,
    read_meta,
    variant_id,
)
from eagle3.core.protocol.wire import ServerInfo

logger = logging.getLogger(__name__)
STATE_FILE = "distill.json"
PARTIAL_FILE = SAMPLES_FILE + ".partial"
ID_SUFFIX = "-distill"


@dataclass(frozen=True)
class DistillConfig:
    max_samples: int | None = None  # None: every sample with a distinct prompt
    max_new_tokens: int = 48  # per assistant turn
    prompts_per_request: int = 16  # one batch: its samples' turn k go in one request
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # sampled runs: default 0 (resumable)
    sampled_replies: int = 0  # extra replies per prompt, sampled at sampled_temperature (ids <id>-distill~s<k>)
    sampled_temperature: float = 0.8
    timeout_s: float = 900.0  # read timeout of one generate request
    overwrite: bool = False
    progress: Callable[[int, int], None] | None = None  # (samples done, samples selected) after each batch

    def __post_init__(self) -> None:
        if self.sampled_replies < 0:
            raise ValueError(f"sampled_replies must be >= 0, got {self.sampled_replies}")
        if self.sampled_replies and self.sampled_temperature <= 0:
            raise ValueError(
                f"sampled_temperature must be > 0 for sampled replies, got {self.sampled_temperature} "
                "(greedy extra replies would repeat the greedy one)"
            )

    def identity(self) -> dict[str, Any]:
        """The settings that decide the output (a resume must use the same)."""
        settings: dict[str, Any] = {
            "max_samples": self.max_samples,
            "max_new_tokens": self.max_new_tokens,
            "prompts_per_request": self.prompts_per_request,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }
        if self.sampled_replies:  # absent otherwise: runs started before the option resume as they were
            settings.update(sampled_replies=self.sampled_replies, sampled_temperature=self.sampled_temperature)
        return settings

    def reply_ids(self, turns: Turns) -> list[str]:
        """The output ids of one prompt's replies, in output order: the main one, then the extra ones."""
        main = turns.sample_id + ID_SUFFIX
        return [main] + [variant_id(main, k) for k in range(1, self.sampled_replies + 1)]


@dataclass(frozen=True)
class DistillSummary:
    out_dir: Path
    n_selected: int  # distinct-prompt samples taken from the input
    n_written: int  # samples written by this run
    n_resumed: int  # samples a previous run had written
    n_dropped: int  # no turn fitted the context
    generated_tokens: int  # by this run
    requests: int  # generate requests of this run
    duration_s: float

    def format_text(self) -> str:
        return (
            f"  {self.n_written} samples distilled ({self.n_resumed} from a previous run, {self.n_dropped} dropped: "
            f"no turn fits the context), {self.generated_tokens} tokens generated in {self.requests} requests, "
            f"{self.duration_s:.0f} s -> {self.out_dir}"
        )


@dataclass(frozen=True)
class Turns:
    """A prepared sample as alternating runs: ``prompts[k]`` precedes the original reply ``replies[k]``."""

    sample_id: str
    prompts: list[list[int]]
    replies: list[list[int]]

    @classmethod
    def of(cls, sample: PreparedSample) -> Turns:
        prompts: list[list[int]] = []
        replies: list[list[int]] = []
        run: list[int] = []
        for i, (token, mask) in enumerate(zip(sample.input_ids, sample.loss_mask, strict=True)):
            run.append(token)
            last = i + 1 == len(sample.input_ids)
            if last or sample.loss_mask[i + 1] != mask:
                if mask:
                    if len(prompts) == len(replies):  # a reply with no prompt before it (the first run)
                        prompts.append([])
                    replies.append(run)
                else:
                    prompts.append(run)
                run = []
        return cls(sample.sample_id, prompts[: len(replies)], replies)  # a trailing prompt is never answered

    @property
    def key(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(p) for p in self.prompts)


def select(prepared_dir: Path, max_samples: int | None) -> list[Turns]:
    """The first ``max_samples`` samples whose prompts (all of them) are distinct and the first non-empty."""
    seen: set[tuple[tuple[int, ...], ...]] = set()
    out: list[Turns] = []
    for sample in iter_prepared(prepared_dir):
        turns = Turns.of(sample)
        if not turns.prompts or not turns.prompts[0] or turns.key in seen:
            continue
        seen.add(turns.key)
        out.append(turns)
        if max_samples is not None and len(out) >= max_samples:
            break
    return out


def after_end_of_turn(reply: list[int], stops: tuple[int, ...]) -> list[int]:
    """The original reply's tokens after its last stop token (the template's text after the end of turn)."""
    at = max((i for i, t in enumerate(reply) if t in stops), default=None)
    return [] if at is None else reply[at + 1 :]


class _Run:
    """One distill run against one server (the loop of ``distill_dataset``)."""

    def __init__(self, client: ExtractionClient, info: ServerInfo, config: DistillConfig, source: str) -> None:
        self.client, self.info, self.config, self.source = client, info, config, source
        self.requests = 0
        self.generated_tokens = 0
        self.dropped = 0
        self.request_cap = info.limit("max_request_tokens", 1 << 62)

    def batch(self, batch_no: int, batch: list[Turns]) -> list[PreparedSample]:
        """The distilled samples of one batch, in batch order (the dropped ones left out)."""
        cfg, stops = self.config, self.info.stop_token_ids
        # (prompt's turns, output id, group): group 0 the main reply, 1 the extra sampled ones
        rows = [(t, out_id, min(j, 1)) for t in batch for j, out_id in enumerate(cfg.reply_ids(t))]
        temperatures = (cfg.temperature, cfg.sampled_temperature)
        ids: dict[str, list[int]] = {out_id: [] for _, out_id, _ in rows}
        mask: dict[str, list[int]] = {out_id: [] for _, out_id, _ in rows}
        alive = set(ids)
        for k in range(max(len(t.replies) for t in batch)):
            for group, temperature in enumerate(temperatures):
                asks: list[tuple[Turns, str, list[int]]] = []
                for t, out_id, in_group in rows:
                    if in_group != group or out_id not in alive or k >= len(t.replies):
                        continue
                    prompt = ids[out_id] + t.prompts[k]
                    if len(prompt) + cfg.max_new_tokens > self.info.max_model_len:
                        alive.discard(out_id)  # the sample ends before this turn
                        continue
                    asks.append((t, out_id, prompt))
                for part, chunk in enumerate(self._chunks(asks)):
                    seed = None
                    if temperature > 0:  # the extra replies' seeds lie 2^40 apart from the main ones'
                        seed = ((cfg.seed or 0) + group * (1 << 40) + batch_no * 65_536 + k * 64 + part) % (1 << 63)
                    out = self._generate([{"id": out_id, "input_ids": p} for _, out_id, p in chunk], temperature, seed)
                    for (t, out_id, _), reply in zip(chunk, out.replies, strict=True):
                        new = list(reply.output_ids)
                        self.generated_tokens += len(new)
                        ids[out_id] += t.prompts[k] + new
                        mask[out_id] += [0] * len(t.prompts[k]) + [1] * len(new)
                        if reply.finish_reason == "stop":
                            tail = after_end_of_turn(t.replies[k], stops)
                            ids[out_id] += tail
                            mask[out_id] += [1] * len(tail)
                        else:
                            alive.discard(out_id)  # cut by max_new_tokens: no later turn follows it
        out_samples = []
        for t, out_id, group in rows:
            if 1 not in mask[out_id]:
                self.dropped += 1
                logger.warning("distill: sample %r dropped: its first prompt leaves no room in the context", out_id)
                continue
            temperature = temperatures[group]
            source = f"{self.source} {t.sample_id} (verifier {self.info.backend} {self.info.model_id}, "
            source += "greedy)" if temperature == 0 else f"T={temperature} top_p={cfg.top_p})"
            out_samples.append(PreparedSample(out_id, ids[out_id], mask[out_id], source))
        return out_samples

    def _chunks(self, asks: list[tuple[Turns, str, list[int]]]) -> Iterator[list[tuple[Turns, str, list[int]]]]:
        """Requests under the server's request-token cap (prompt + max_new_tokens each), in order."""
        return consecutive_runs(asks, lambda ask: len(ask[2]) + self.config.max_new_tokens, self.request_cap)

    def _generate(self, prompts: list[dict[str, Any]], temperature: float, seed: int | None) -> GenerateResponse:
        cfg = self.config
        self.requests += 1
        return self.client.generate(
            prompts,
            max_new_tokens=cfg.max_new_tokens,
            temperature=temperature,
            top_p=cfg.top_p,
            seed=seed,
            timeout_s=cfg.timeout_s,
        )


def read_partial(path: Path) -> list[PreparedSample]:
    """The complete lines of a partial samples file; a torn last line (a kill mid-write) is cut off."""
    if not path.is_file():
        return []
    samples: list[PreparedSample] = []
    good_bytes = 0
    with open(path, "rb") as fh:
        lines = fh.readlines()
    for n, raw in enumerate(lines, start=1):
        try:
            if not raw.endswith(b"\n"):
                raise PreparedFormatError("no newline: an unfinished write")
            samples.append(PreparedSample.from_json(raw.decode()))
        except (ValueError, PreparedFormatError) as exc:
            if n != len(lines):
                raise PreparedFormatError(f"{path}:{n}: {exc} (not the last line: the file is damaged)") from exc
            logger.warning("distill: cutting a torn last line of %s (%s)", path, exc)
            with open(path, "r+b") as fh:
                fh.truncate(good_bytes)
            break
        good_bytes += len(raw)
    return samples


def server_identity(info: ServerInfo) -> dict[str, Any]:
    """What decides a server's replies: a rerun (distill's resume, self-instruct's reuse) needs the same."""
    return {
        "model_id": info.model_id,
        "revision": info.revision,
        "backend": info.backend,
        "dtype": info.dtype,
        "tokenizer_sha256": info.tokenizer_sha256,
        "stop_token_ids": list(info.stop_token_ids),
    }


def _check_resume(out: Path, state: dict[str, Any]) -> None:
    path = out / STATE_FILE
    if not path.is_file():
        return
    before = json.loads(path.read_text())
    for key in ("prepared", "server", "settings"):
        if before.get(key) != state[key]:
            raise IncompatibleError(
                f"{out} was started with other {key} ({before.get(key)} != {state[key]}); "
                "rerun with the same ones, another --out, or --overwrite"
            )


def check_can_generate_for(info: ServerInfo, meta: PreparedMeta, prepared: Path) -> None:
    """``IncompatibleError`` unless the server can generate (``/v1/info`` ``can_generate``) with the
    tokenizer and vocabulary ``prepared`` was tokenized for (distill and self-instruct ask before any request)."""
    if not info.can_generate:
        raise IncompatibleError(f"{info.url}: the {info.backend} backend cannot generate (/v1/info can_generate)")
    if info.tokenizer_sha256 != meta.tokenizer_sha256 or info.vocab_size != meta.vocab_size:
        raise IncompatibleError(
            f"{prepared} was prepared for another tokenizer or vocabulary than {info.url} serves "
            f"({meta.model}, vocab {meta.vocab_size}; server: {info.model_id}, vocab {info.vocab_size}); "
            "prepare it again with the server's --model"
        )


def distill_dataset(
    prepared_dir: str | Path,
    out_dir: str | Path,
    server: str | ExtractionClient,
    api_key: str | None = None,
    config: DistillConfig | None = None,
) -> DistillSummary:
    """Write ``out_dir`` (a prepared directory) with the verifier's replies; resumes (module docstring)."""
    cfg = config or DistillConfig()
    if (cfg.temperature > 0 or cfg.sampled_replies) and cfg.seed is None:
        cfg = dataclasses.replace(cfg, seed=0)
    prepared, out = Path(prepared_dir), Path(out_dir)
    started = time.monotonic()
    meta = read_meta(prepared)
    client = server if isinstance(server, ExtractionClient) else ExtractionClient(server, api_key)
    try:
        info = client.info()
        check_can_generate_for(info, meta, prepared)
        state = {"prepared": str(prepared.resolve()), "server": server_identity(info), "settings": cfg.identity()}
        if cfg.overwrite:
            for name in (SAMPLES_FILE, PARTIAL_FILE, STATE_FILE, META_FILE, STATS_FILE):
                (out / name).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        _check_resume(out, state)
        selected = select(prepared, cfg.max_samples)
        if (out / SAMPLES_FILE).is_file():
            n_done = sum(1 for _ in iter_prepared(out))
            return DistillSummary(out, len(selected), 0, n_done, 0, 0, 0, time.monotonic() - started)
        (out / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        done = read_partial(out / PARTIAL_FILE)
        done_ids = {s.sample_id for s in done}
        n_resumed, longest = len(done), max((s.n_tokens for s in done), default=0)
        run = _Run(client, info, cfg, str(prepared))
        n_written = 0
        per = cfg.prompts_per_request
        with open(out / PARTIAL_FILE, "a", encoding="utf-8") as fh:
            for batch_no, start in enumerate(range(0, len(selected), per)):
                batch = selected[start : start + per]
                if all(out_id in done_ids for t in batch for out_id in cfg.reply_ids(t)):
                    continue
                for sample in run.batch(batch_no, batch):
                    if sample.sample_id in done_ids:
                        continue
                    fh.write(sample.to_json() + "\n")
                    done_ids.add(sample.sample_id)
                    longest = max(longest, sample.n_tokens)
                    n_written += 1
                fh.flush()
                os.fsync(fh.fileno())
                if cfg.progress is not None:
                    cfg.progress(min(start + per, len(selected)), len(selected))
        out_meta = dataclasses.replace(meta, max_length=max(longest, 1))
        (out / META_FILE).write_text(out_meta.to_json())
        summary = DistillSummary(
            out,
            len(selected),
            n_written,
            n_resumed,
            run.dropped,
            run.generated_tokens,
            run.requests,
            time.monotonic() - started,
        )
        stats = {
            "samples_kept": n_written + n_resumed,
            "source": str(prepared),
            **cfg.identity(),
            "server": state["server"],
            "generated_tokens": run.generated_tokens,
            "dropped": run.dropped,
            "generate_s": round(summary.duration_s, 1),
        }
        (out / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
        os.replace(out / PARTIAL_FILE, out / SAMPLES_FILE)
        return summary
    finally:
        if client is not server:
            client.close()
