"""``extract_dataset``: a prepared dataset -> a features directory, from one or more servers, resumable.

One ``_ExtractRun`` per call, in this order (nothing is requested before every check passed):

1. ``connect``: ``/v1/info`` from the first server that answers, read once. A server that says it is
   still loading is waited for (``wait_ready_s``; by default as long as the server itself expects to
   load, and then some: ``client/base_client.py::ReadyPoll``), with a line now and then; the wait is
   not counted in the run's tokens/s. Its tokenizer hash and vocab size must match the prepared
   ``meta.json`` (a dataset tokenized for another model would train a useless draft).
2. ``open``: the features directory (``FeaturesWriter.open``): a new one gets ``features.json``; an
   old one must hold the same model (``ModelIdentity``: model, revision by content, layers, sizes,
   tokenizer), its torn manifest tail and orphans are removed, and the sample ids already recorded are
   skipped. Then the prepared samples still to do are scanned: token ids in range, none over the
   server's limits, free disk for all of them.
3. ``write_all``: a ``SampleFetcher`` (``client/fetch.py``: requests cut once, ``requests_per_server``
   threads per URL, retries and failover, a byte budget; every other server's ``/v1/info`` read once
   and checked against the same identity) yields decoded samples; this thread appends them to shards
   in arrival order.

Ctrl-C (and SIGTERM under the CLI) stops the workers, writes the complete samples already received
as a last shard, and leaves a directory that the same command resumes. A SIGKILL loses at most the
samples of the shard being filled and of the one being written in the background (the writer thread
writes shard k while this thread fills shard k+1).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from eagle3.client.errors import FeaturesWriteError, IncompatibleError, SampleFailure, ServiceUnavailableError
from eagle3.client.fetch import FetchSettings, SampleFetcher
from eagle3.client.progress import Progress
from eagle3.client.sdk import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S, ExtractionClient
from eagle3.core.features_writer import DEFAULT_SHARD_MB, FeaturesWriter, check_free_disk
from eagle3.core.protocol.features import CODEC_NONE, DTYPE_BF16, SHARD_CODECS, SHARDS_DIR, FeaturesMeta
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
    # a server still loading: None waits as long as the server expects its load to take and then some
    # (ReadyPoll; 30 min when it has no estimate); N > 0 waits up to N s; 0 does not wait
    wait_ready_s: float | None = None
    progress: bool | None = None  # None: a tqdm bar on a terminal or in Jupyter, a log line every 30 s otherwise
    # the features' format (features.json, docs/training.md "Features that fit the disk"): "bfloat16" (lossless)
    # or "float8_e4m3fn" (FP8 on the wire and at rest, about half the bytes); compress_shards: lossless zstd
    # at rest (zstd+planes for bf16, zstd for FP8), decompressed by the reader per sample
    feature_dtype: str = DTYPE_BF16
    compress_shards: bool = False


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
    wall_s: float = 0.0  # from the first /v1/info answer to the end: the wait for a loading server is not in it
    wait_s: float = 0.0  # waiting for a server still loading its model
    # seconds per client stage: receive/verify/decode summed over the request threads, write on the writer's
    stage_s: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def format_text(self) -> str:
        lines = [
            f"samples   {self.n_samples} extracted, {self.n_skipped} already done, {self.n_failed} failed",
            f"tokens    {self.n_tokens:,} in {self.wall_s:.1f} s ({self.tokens_per_s:,.0f} tokens/s)"
            + (f", after {self.wait_s:.0f} s waiting for the server to load" if self.wait_s >= 1 else ""),
            f"disk      {self.bytes_written / 1e6:,.1f} MB written, "
            f"{self.bytes_on_disk / 1e6:,.1f} MB in {self.out_dir}",
            f"wire      {self.wire_bytes / 1e6:,.1f} MB received"
            + (f" ({self.wire_bytes / self.bytes_written:.2f} of disk)" if self.bytes_written else ""),
        ]
        lines += [f"failed    {f.sample_id}: {f.type}: {f.message}" for f in self.failures[:5]]
        return "\n".join(lines)


FRAMES_IN_FLIGHT_BYTES = 64 << 20  # the buffer pool's room for frames being received (one per request thread)


def features_meta(
    info: ServerInfo, prepared_dir: Path, n_samples_total: int, dtype: str = DTYPE_BF16, compress: bool = False
) -> FeaturesMeta:
    """What ``features.json`` records: the server's model identity, the format on disk (``dtype``: bfloat16 or
    float8_e4m3fn; ``compress``: the dtype's lossless codec at rest) and the dataset."""
    if dtype not in SHARD_CODECS:
        raise ValueError(f"feature dtype must be one of {', '.join(SHARD_CODECS)}, got {dtype!r}")
    return FeaturesMeta(
        **info.identity.as_fields(),
        dtype=dtype,
        prepared_dir=str(prepared_dir.resolve()),
        n_samples_total=n_samples_total,
        shard_codec=SHARD_CODECS[dtype] if compress else CODEC_NONE,
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
    run = _ExtractRun(
        Path(prepared_dir),
        Path(out_dir),
        [urls] if isinstance(urls, str) else list(urls),
        api_key,
        config or ExtractConfig(),
        transport,
        sleep,
    )
    run.connect()
    run.open()
    try:  # the directory stays locked until the run ends (FeaturesWriter.open)
        run.write_all()
        return run.summary
    finally:
        run.writer.release()


@dataclass
class _ExtractRun:
    """One ``extract_dataset`` call: ``connect``, ``open``, ``write_all`` (the module docstring)."""

    prepared_dir: Path
    out_dir: Path
    urls: list[str]
    api_key: str | None
    config: ExtractConfig
    transport: httpx.BaseTransport | None
    sleep: Callable[[float], None]

    def __post_init__(self) -> None:
        self.prepared = read_meta(self.prepared_dir)
        self.summary = ExtractSummary(str(self.out_dir))

    def connect(self) -> None:
        """``self.info``: the first answering server's ``/v1/info``, once it is loaded (``wait_ready_s``)."""
        config, waiting_since = self.config, time.monotonic()
        with ExtractionClient(
            self.urls,
            self.api_key,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            transport=self.transport,
            sleep=self.sleep,
        ) as probe:
            loading = probe.loading_state() if not config.wait_ready_s else None
            if config.wait_ready_s or (config.wait_ready_s is None and loading is not None):
                probe.wait_until_ready(config.wait_ready_s, report=logger.info)  # None: the server's own estimate
            elif loading is not None:
                logger.warning(
                    "%s is not ready (%s); trying for about %d s (--wait-ready-s 0). Without --wait-ready-s, "
                    "eagle3 extract waits as long as the server expects to load",
                    probe.url,
                    loading,
                    config.max_retries * LOADING_RETRY_AFTER_S,
                )
            self.summary.wait_s = time.monotonic() - waiting_since
            self.started = time.monotonic()  # tokens/s counts from here: the wait is not in it
            try:
                self.info = probe.info()
            except ServiceUnavailableError as exc:
                if exc.reason != "loading":
                    raise
                raise ServiceUnavailableError(
                    f"{exc} -- the server is still loading its model: rerun without --wait-ready-s (it then "
                    "waits as long as the server expects to load) or with --wait-ready-s SECONDS (e.g. 3600)",
                    status_code=exc.status_code,
                    url=exc.url,
                    type=exc.type,
                    reason=exc.reason,
                    request_id=exc.request_id,
                    retry_after_s=exc.retry_after_s,
                ) from None
        check_prepared(self.prepared, self.info, self.prepared_dir)

    def open(self) -> None:
        """Scan the prepared samples, open (or resume) the features directory, check limits and disk."""
        config, info = self.config, self.info
        # pass 1 of 2 over samples.jsonl: validate every sample, keep only (id, length, source)
        scanned = [
            (s.sample_id, s.n_tokens, s.source) for s in _limited(self.prepared_dir, config.limit, info.vocab_size)
        ]
        self.meta = features_meta(info, self.prepared_dir, len(scanned), config.feature_dtype, config.compress_shards)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.writer = FeaturesWriter.open(
            self.out_dir, self.meta, shard_mb=config.shard_mb, verify=config.verify, background=True
        )
        try:
            longest = min(info.max_model_len, info.limit("max_request_tokens", info.max_model_len))
            self.n_todo = self.n_tokens_todo = 0
            for sample_id, n_tokens, source in scanned:
                if sample_id in self.writer.done_ids:
                    self.summary.n_skipped += 1
                    continue
                if n_tokens > longest:
                    raise IncompatibleError(
                        f"sample {sample_id!r} ({source}) has {n_tokens} tokens, over the server's "
                        f"limit of {longest}; re-run eagle3 prepare with --max-length {longest}"
                    )
                self.n_todo += 1
                self.n_tokens_todo += n_tokens
            if config.check_disk and self.n_tokens_todo:
                check_free_disk(self.out_dir, self.n_tokens_todo, self.meta, config.shard_mb)
        except BaseException:
            self.writer.release()
            raise
        logger.info(
            "%d samples (%d tokens) to extract, %d already done",
            self.n_todo,
            self.n_tokens_todo,
            self.summary.n_skipped,
        )
        sizes = feature_sizes(self.meta.n_layers_stored, self.meta.hidden_size, self.meta.dtype)
        logger.info("%s", preflight_line(sizes, self.n_todo, self.n_tokens_todo))  # before paying (core/sizes.py)

    def fetcher(self) -> SampleFetcher:
        config = self.config
        # one pool for every request thread: a sample's buffer comes back once the writer has written it and
        # let go of it (client/buffer_pool.py). In flight at most: the byte budget's samples, the writer's
        # shard being filled and the one being written (it keeps their arrays until then), and the frames
        # being received.
        pool_bytes = (config.buffer_mb << 20) + 2 * int(config.shard_mb * 2**20) + FRAMES_IN_FLIGHT_BYTES
        settings = FetchSettings(
            codec=config.codec,
            cache=config.cache,
            dtype=config.feature_dtype,
            request_tokens=config.request_tokens,
            requests_per_server=config.requests_per_server,
            buffer_bytes=config.buffer_mb << 20,
            pool_bytes=pool_bytes if config.recycle_buffers else 0,
            max_retries=config.max_retries,
            timeout_s=config.timeout_s,
        )
        todo = _todo(self.prepared_dir, config.limit, set(self.writer.done_ids))  # pass 2: the samples, streamed
        return SampleFetcher(
            self.urls,
            self.api_key,
            self.meta.identity,
            todo,
            settings,
            known=[self.info],
            transport=self.transport,
            sleep=self.sleep,
        )

    def write_all(self) -> None:
        """Every sample the fetcher yields into the directory; on any exit, what arrived is flushed (unless
        the disk is what failed) and the summary completed."""
        summary, writer = self.summary, self.writer
        fetcher = self.fetcher()
        progress = Progress(self.n_todo, self.n_tokens_todo, enabled=self.config.progress)
        flush_on_exit = True
        write_s = 0.0
        try:
            for item in fetcher:
                if isinstance(item, ExtractedSample):
                    started = time.perf_counter()
                    writer.add(item)
                    write_s += time.perf_counter() - started
                    fetcher.release(item)
                    summary.n_samples += 1
                    summary.n_tokens += item.n_tokens
                    progress.update(1, item.n_tokens, fetcher.wire_bytes)
                else:
                    self._failed(item)
        except FeaturesWriteError:
            flush_on_exit = False  # the disk is full: keep what the manifest has
            raise
        finally:
            fetcher.stop.set()
            started = time.perf_counter()
            try:
                if flush_on_exit:
                    writer.flush()  # complete samples received so far: on disk, not lost
            except FeaturesWriteError as exc:
                logger.error("%s", exc)
            finally:
                writer.shutdown()
            summary.stage_s = {**fetcher.stage_s, "write": write_s + time.perf_counter() - started}
            summary.bytes_written = writer.bytes_written
            summary.wire_bytes = fetcher.wire_bytes
            progress.close()
            fetcher.close()
            summary.wall_s = time.monotonic() - self.started
            summary.bytes_on_disk = sum(p.stat().st_size for p in (self.out_dir / SHARDS_DIR).iterdir())

    def _failed(self, failure: SampleFailure) -> None:
        self.summary.n_failed += 1
        if len(self.summary.failures) < 20:
            self.summary.failures.append(failure)
        logger.warning("sample %r failed: %s: %s", failure.sample_id, failure.type, failure.message)


def _limited(prepared_dir: Path, limit: int | None, vocab_size: int | None = None) -> Iterator[PreparedSample]:
    for index, sample in enumerate(iter_prepared(prepared_dir, vocab_size=vocab_size)):
        if limit is not None and index >= limit:
            return
        yield sample


def _todo(prepared_dir: Path, limit: int | None, done: set[str]) -> Iterator[PreparedSample]:
    return (sample for sample in _limited(prepared_dir, limit) if sample.sample_id not in done)
