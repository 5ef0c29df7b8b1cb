"""``extract_dataset``: a prepared dataset -> a features directory, from one or more servers, resumable.

Order of work (nothing is requested before every check passed):

1. ``/v1/info`` from the first server that answers; its tokenizer hash and vocab size must match the
   prepared ``meta.json`` (a dataset tokenized for another model would train a useless draft).
2. Open the features directory (``FeaturesWriter.open``): a new one gets ``features.json``; an old one
   must hold the same model/revision/layers/hidden size, its torn manifest tail and orphans are
   removed, and the sample ids already recorded are skipped.
3. Scan the prepared samples still to do: token ids in range, no sample over the server's limits,
   free disk for all of them.
4. Workers (``requests_per_server`` threads per URL, each with its own connection,
   ``client/extract_work.py``) stream batches of at most ``request_tokens`` tokens and decode them;
   the writer (this thread) appends shards as samples arrive, in arrival order.

Ctrl-C (and SIGTERM under the CLI) stops the workers, writes the complete samples already received
as a last shard, and leaves a directory that the same command resumes. A SIGKILL loses at most the
samples of the shard being filled and of the one being written in the background (the writer thread
writes shard k while this thread fills shard k+1).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from eagle3.client.buffer_pool import BufferPool
from eagle3.client.errors import (
    FeaturesWriteError,
    IncompatibleError,
    NoServerAvailableError,
    SampleFailure,
    ServiceUnavailableError,
)
from eagle3.client.extract_work import BatchSource, ByteBudget, ServerWorker, cut_batches
from eagle3.client.progress import Progress
from eagle3.client.sdk import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S, ExtractionClient
from eagle3.core.features_writer import DEFAULT_SHARD_MB, IDENTITY_FIELDS, FeaturesWriter, check_free_disk
from eagle3.core.protocol.features import SHARDS_DIR, FeaturesMeta
from eagle3.core.protocol.prepared import PreparedMeta, PreparedSample, iter_prepared, read_meta
from eagle3.core.protocol.wire import ServerInfo
from eagle3.core.sample import ExtractedSample
from eagle3.core.sizes import feature_sizes, preflight_line

logger = logging.getLogger(__name__)
LOADING_RETRY_AFTER_S = 5  # the server's Retry-After while loading: retries of a loading server last about this each


@dataclass(frozen=True)
class ExtractConfig:
    codec: str | None = None  # None: the server's default_codec
    cache: str | None = None  # "bypass": the server computes every sample (not from its feature cache)
    request_tokens: int = 65536  # per /v1/extract request (capped by the server's max_request_tokens)
    requests_per_server: int = 2  # in flight at once per server URL: the server computes while we decode
    shard_mb: float = DEFAULT_SHARD_MB  # shard size target on disk
    buffer_mb: int = 256  # decoded samples waiting for the writer (back-pressure beyond this)
    recycle_buffers: bool = True  # reuse written samples' memory for new frames (client/buffer_pool.py)
    max_retries: int = DEFAULT_MAX_RETRIES  # failures in a row before a server is given up
    timeout_s: float = DEFAULT_TIMEOUT_S
    limit: int | None = None  # only the first N prepared samples
    verify: bool = False  # checksum (xxh3-128, or sha256 in old manifests) of every recorded shard first
    check_disk: bool = True
    wait_ready_s: float = 0.0  # wait this long for a loading server before failing
    progress: bool | None = None  # None: a tqdm bar on a terminal or in Jupyter, a log line every 30 s otherwise


@dataclass
class ExtractSummary:
    out_dir: str
    n_samples: int = 0  # written by this run
    n_tokens: int = 0
    n_skipped: int = 0  # already in the directory (resume)
    n_failed: int = 0
    failures: list[SampleFailure] = field(default_factory=list)  # the first 20
    bytes_written: int = 0
    bytes_on_disk: int = 0  # all shards of the directory
    wire_bytes: int = 0
    wall_s: float = 0.0
    # seconds per client stage: receive/verify/decode summed over the request threads, write on the writer's
    stage_s: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def format_text(self) -> str:
        lines = [
            f"samples   {self.n_samples} extracted, {self.n_skipped} already done, {self.n_failed} failed",
            f"tokens    {self.n_tokens:,} in {self.wall_s:.1f} s ({self.tokens_per_s:,.0f} tokens/s)",
            f"disk      {self.bytes_written / 1e6:,.1f} MB written, "
            f"{self.bytes_on_disk / 1e6:,.1f} MB in {self.out_dir}",
            f"wire      {self.wire_bytes / 1e6:,.1f} MB received"
            + (f" ({self.wire_bytes / self.bytes_written:.2f} of disk)" if self.bytes_written else ""),
        ]
        lines += [f"failed    {f.sample_id}: {f.type}: {f.message}" for f in self.failures[:5]]
        return "\n".join(lines)


FRAMES_IN_FLIGHT_BYTES = 64 << 20  # the buffer pool's room for frames being received (one per request thread)


def features_meta(info: ServerInfo, prepared_dir: Path, n_samples_total: int) -> FeaturesMeta:
    return FeaturesMeta(
        model_id=info.model_id,
        revision=info.revision,
        aux_layer_ids=info.aux_layer_ids,
        final_layer_id=info.final_layer_id,
        hidden_size=info.hidden_size,
        vocab_size=info.vocab_size,
        dtype="bfloat16",
        tokenizer_sha256=info.tokenizer_sha256,
        prepared_dir=str(prepared_dir.resolve()),
        n_samples_total=n_samples_total,
    )


def check_prepared(prepared: PreparedMeta, info: ServerInfo, prepared_dir: Path) -> None:
    if prepared.tokenizer_sha256 != info.tokenizer_sha256:
        raise IncompatibleError(
            f"{prepared_dir} was tokenized with tokenizer {prepared.tokenizer_sha256[:12]} ({prepared.model}) but "
            f"{info.url} serves {info.model_id} with tokenizer {info.tokenizer_sha256[:12]}; run eagle3 prepare "
            "with the server's model"
        )
    if prepared.vocab_size != info.vocab_size:
        raise IncompatibleError(
            f"{prepared_dir} has vocab_size {prepared.vocab_size}, {info.url} has {info.vocab_size}"
        )


def extract_dataset(
    prepared_dir: str | Path,
    out_dir: str | Path,
    urls: str | list[str],
    api_key: str | None = None,
    config: ExtractConfig | None = None,
    *,
    transport: httpx.BaseTransport | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ExtractSummary:
    """Extract every sample of ``prepared_dir`` not yet in ``out_dir``; see the module docstring."""
    config = config or ExtractConfig()
    prepared_dir, out_dir = Path(prepared_dir), Path(out_dir)
    url_list = [urls] if isinstance(urls, str) else list(urls)
    started = time.monotonic()
    prepared = read_meta(prepared_dir)

    with ExtractionClient(url_list, api_key, timeout_s=config.timeout_s, max_retries=config.max_retries,
                          transport=transport, sleep=sleep) as probe:  # fmt: skip
        if config.wait_ready_s > 0:
            probe.wait_until_ready(config.wait_ready_s, report=logger.info)
        else:
            loading = probe.loading_state()
            if loading is not None:
                logger.warning(
                    "%s is not ready (%s); trying for about %d s. For a verifier that loads longer, pass "
                    "--wait-ready-s SECONDS (ExtractConfig.wait_ready_s), e.g. --wait-ready-s 3600",
                    probe.url, loading, config.max_retries * LOADING_RETRY_AFTER_S,
                )  # fmt: skip
        try:
            info = probe.info()
        except ServiceUnavailableError as exc:
            if exc.reason != "loading":
                raise
            raise ServiceUnavailableError(
                f"{exc} -- the server is still loading its model: rerun with --wait-ready-s SECONDS "
                "(e.g. 3600) to wait for it",
                status_code=exc.status_code, url=exc.url, type=exc.type, reason=exc.reason,
                request_id=exc.request_id, retry_after_s=exc.retry_after_s,
            ) from None  # fmt: skip
    check_prepared(prepared, info, prepared_dir)
    # pass 1 of 2 over samples.jsonl: validate every sample, keep only (id, length, source)
    scanned = [(s.sample_id, s.n_tokens, s.source) for s in _limited(prepared_dir, config.limit, info.vocab_size)]
    meta = features_meta(info, prepared_dir, len(scanned))
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = FeaturesWriter.open(out_dir, meta, shard_mb=config.shard_mb, verify=config.verify, background=True)

    try:  # the directory stays locked until the run ends (FeaturesWriter.open)
        max_request_tokens = min(config.request_tokens, info.limit("max_request_tokens", config.request_tokens))
        longest = min(info.max_model_len, info.limit("max_request_tokens", info.max_model_len))
        n_todo, n_tokens_todo, n_skipped = 0, 0, 0
        for sample_id, n_tokens, source in scanned:
            if sample_id in writer.done_ids:
                n_skipped += 1
                continue
            if n_tokens > longest:
                raise IncompatibleError(
                    f"sample {sample_id!r} ({source}) has {n_tokens} tokens, over the server's "
                    f"limit of {longest}; re-run eagle3 prepare with --max-length {longest}"
                )
            n_todo += 1
            n_tokens_todo += n_tokens
        if config.check_disk and n_tokens_todo:
            check_free_disk(out_dir, n_tokens_todo, meta, config.shard_mb)
        logger.info("%d samples (%d tokens) to extract, %d already done", n_todo, n_tokens_todo, n_skipped)
        sizes = feature_sizes(meta.n_layers_stored, meta.hidden_size, meta.dtype)
        logger.info("%s", preflight_line(sizes, n_todo, n_tokens_todo))  # before paying (core/sizes.py)

        summary = ExtractSummary(str(out_dir), n_skipped=n_skipped)
        batches = cut_batches(  # pass 2: the samples themselves, streamed
            _todo(prepared_dir, config.limit, set(writer.done_ids)),
            max_request_tokens,
            info.limit("max_body_bytes", 1 << 40),
        )
        _run(writer, batches, url_list, api_key, config, meta, n_todo, n_tokens_todo, summary, transport, sleep)
        summary.wall_s = time.monotonic() - started
        summary.bytes_on_disk = sum(p.stat().st_size for p in (out_dir / SHARDS_DIR).iterdir())
        return summary
    finally:
        writer.release()


def _run(
    writer: FeaturesWriter,
    batches: Iterator[list[PreparedSample]],
    urls: list[str],
    api_key: str | None,
    config: ExtractConfig,
    meta: FeaturesMeta,
    n_todo: int,
    n_tokens_todo: int,
    summary: ExtractSummary,
    transport: httpx.BaseTransport | None,
    sleep: Callable[[float], None],
) -> None:
    source = BatchSource(batches)
    results: queue.Queue[ExtractedSample | SampleFailure] = queue.Queue()
    budget = ByteBudget(config.buffer_mb << 20)
    stop = threading.Event()

    def check_info(info: ServerInfo) -> None:
        for name in IDENTITY_FIELDS:
            if getattr(meta, name) != getattr(info, name):
                raise IncompatibleError(
                    f"{info.url} serves {name}={getattr(info, name)!r}, not {getattr(meta, name)!r}"
                )

    if config.requests_per_server < 1:
        raise ValueError(f"requests_per_server must be at least 1, got {config.requests_per_server}")
    # one pool for every request thread: a sample's buffer comes back once the writer has written it and let
    # go of it (client/buffer_pool.py). In flight at most: the byte budget's samples, the writer's shard being
    # filled and the one being written (it keeps their arrays until then), and the frames being received.
    pool_bytes = (config.buffer_mb << 20) + 2 * int(config.shard_mb * 2**20) + FRAMES_IN_FLIGHT_BYTES
    pool = BufferPool(pool_bytes) if config.recycle_buffers else None
    clients = [
        ExtractionClient(
            url,
            api_key,
            timeout_s=config.timeout_s,
            max_retries=1,
            transport=transport,
            sleep=sleep,
            cache=config.cache,
            buffer_pool=pool,
            max_in_flight_requests=1,  # one batch = one request here: requests_per_server is the concurrency
        )  # fmt: skip
        for url in urls
        for _ in range(config.requests_per_server)
    ]
    workers = [
        ServerWorker(
            c,
            source,
            results,
            budget,
            stop,
            codec=config.codec,
            max_failures=config.max_retries,
            check_info=check_info,
            sleep=sleep,
        )  # fmt: skip
        for c in clients
    ]
    progress = Progress(n_todo, n_tokens_todo, enabled=config.progress)
    flush_on_exit = True
    write_s = 0.0
    try:
        for worker in workers:
            worker.start()
        while True:
            try:
                item = results.get(timeout=0.1)
            except queue.Empty:
                item = None
            if isinstance(item, ExtractedSample):
                started = time.perf_counter()
                writer.add(item)
                write_s += time.perf_counter() - started
                budget.release(item.hidden_states_bf16.nbytes)
                summary.n_samples += 1
                summary.n_tokens += item.n_tokens
                progress.update(1, item.n_tokens, sum(c.wire_bytes for c in clients))
            elif item is not None:
                summary.n_failed += 1
                if len(summary.failures) < 20:
                    summary.failures.append(item)
                logger.warning("sample %r failed: %s: %s", item.sample_id, item.type, item.message)
            if item is None:
                fatal = next((w.fatal for w in workers if w.fatal is not None), None)
                if fatal is not None:
                    raise fatal
                if source.finished and results.empty():
                    break
                if all(w.gave_up or not w.is_alive() for w in workers) and results.empty():
                    errors = "; ".join(f"{w.client.url}: {w.last_error}" for w in workers)
                    raise NoServerAvailableError(
                        f"every server failed {config.max_retries + 1} times in a row ({errors})"
                    )
    except FeaturesWriteError:
        flush_on_exit = False  # the disk is full: keep what the manifest has
        raise
    finally:
        stop.set()
        started = time.perf_counter()
        try:
            if flush_on_exit:
                writer.flush()  # complete samples received so far: on disk, not lost
        except FeaturesWriteError as exc:
            logger.error("%s", exc)
        finally:
            writer.shutdown()
        write_s += time.perf_counter() - started
        summary.bytes_written = writer.bytes_written
        summary.wire_bytes = sum(c.wire_bytes for c in clients)
        summary.stage_s = {k: sum(c.stage_s[k] for c in clients) for k in ("receive", "verify", "decode")}
        summary.stage_s["write"] = write_s
        progress.close()
        for worker in workers:
            worker.join(timeout=2.0)
        for c in clients:
            c.close()


def _limited(prepared_dir: Path, limit: int | None, vocab_size: int | None = None) -> Iterator[PreparedSample]:
    for index, sample in enumerate(iter_prepared(prepared_dir, vocab_size=vocab_size)):
        if limit is not None and index >= limit:
            return
        yield sample


def _todo(prepared_dir: Path, limit: int | None, done: set[str]) -> Iterator[PreparedSample]:
    return (sample for sample in _limited(prepared_dir, limit) if sample.sample_id not in done)
