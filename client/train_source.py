"""``ServerSource``: the features ``eagle3 train --server`` trains on, from one or more extraction servers.

It is the SDK side of ``eagle3.draft_trainer.stream_data.FeatureSource`` (the trainer never imports the
SDK): ``n_workers = len(urls) * requests_per_server`` ``ExtractionClient``s, worker ``w``'s primary
server being ``urls[w // requests_per_server]`` and the others its fallbacks in list order. What each
fetch inherits from the SDK (``client/sdk.py``): a retry resends only the samples not received yet, the
retry budget (``max_retries``, exponential backoff up to 16 s) starts again whenever a sample arrives,
and a connection failure moves on to the next URL. So a server killed mid-request, or restarted, stalls
its requests until it answers again or they move to another server; a sample is delivered whole or not
at all. A server's deterministic answers (sample too long, token ids out of range) are not retried:
the fetch raises naming the sample.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from eagle3.client.errors import (
    APIConnectionError,
    IncompatibleError,
    NoServerAvailableError,
    SampleFailedError,
    ServiceUnavailableError,
)
from eagle3.client.extract import check_prepared, features_meta
from eagle3.client.sdk import DEFAULT_TIMEOUT_S, ExtractionClient
from eagle3.core.protocol.features import DTYPE_BF16, FeaturesMeta
from eagle3.core.protocol.prepared import PreparedSample, read_meta
from eagle3.core.protocol.wire import ServerInfo
from eagle3.core.sample import ExtractedSample

logger = logging.getLogger(__name__)

DEFAULT_TRAIN_MAX_RETRIES = 10  # ~100 s of backoff without a sample: a restarted server comes back within it
_METRIC_RE = re.compile(r'^(eagle3_stage_seconds_total\{[^}]*stage="forward"[^}]*\}|eagle3_uptime_seconds)\s+(\S+)')


class ServerSource:
    def __init__(
        self,
        urls: str | Sequence[str],
        api_key: str | None = None,
        *,
        requests_per_server: int = 2,
        codec: str | None = None,
        cache: str | None = None,
        dtype: str = DTYPE_BF16,
        compress_shards: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_TRAIN_MAX_RETRIES,
        wait_ready_s: float | None = None,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("give at least one server URL")
        if requests_per_server < 1:
            raise ValueError(f"requests_per_server must be at least 1, got {requests_per_server}")
        self.api_key, self.codec, self.wait_ready_s = api_key, codec, wait_ready_s
        self.requests_per_server = requests_per_server
        # the features' format: asked of the servers (dtype) and, in the hybrid mode, the cache directory's
        self.dtype, self.compress_shards = dtype, compress_shards
        self._clients = [
            ExtractionClient(
                self.urls[i:] + self.urls[:i],
                api_key,
                timeout_s=timeout_s,
                max_retries=max_retries,
                cache=cache,
                dtype=dtype,
                max_in_flight_requests=1,
            )
            for i in range(len(self.urls))
            for _ in range(requests_per_server)
        ]
        self._http = httpx.Client(timeout=5.0)

    @property
    def n_workers(self) -> int:
        return len(self._clients)

    def open(self, prepared_dir: Path, n_samples: int) -> tuple[FeaturesMeta, int]:
        prepared = read_meta(prepared_dir)
        infos: list[ServerInfo] = []
        if self.wait_ready_s is None or self.wait_ready_s > 0:  # as extract_dataset: a loading verifier is waited
            with ExtractionClient(self.urls, self.api_key) as all_servers:  # for, by its own estimate unless told
                all_servers.wait_until_ready(self.wait_ready_s, report=logger.info)
        for url in self.urls:
            with ExtractionClient(url, self.api_key, max_retries=1) as probe:
                try:
                    info = probe.info()
                except (APIConnectionError, ServiceUnavailableError) as exc:
                    logger.warning("%s is not ready (%s); its requests go to the other servers", url, exc)
                    continue
            check_prepared(prepared, info, prepared_dir)
            difference = infos[0].identity.diff(info.identity) if infos else ""
            if difference:  # the one model-identity comparison (core/protocol/model_identity.py)
                raise IncompatibleError(
                    f"{info.url} serves another model than {infos[0].url} ({difference}; {infos[0].url} -> "
                    f"{info.url}): every --server must serve the same verifier and layers"
                )
            infos.append(info)
        if not infos:
            raise NoServerAvailableError(f"none of {', '.join(self.urls)} answers /v1/info")
        longest = min(min(i.max_model_len, i.limit("max_request_tokens", i.max_model_len)) for i in infos)
        return features_meta(infos[0], prepared_dir, n_samples, self.dtype, self.compress_shards), longest

    def fetch(self, samples: Sequence[PreparedSample], worker: int) -> Iterator[ExtractedSample]:
        failures = []
        for outcome in self._clients[worker].extract_stream(samples, self.codec):
            if isinstance(outcome, ExtractedSample):
                yield outcome
            else:
                failures.append(outcome)
        if failures:  # what the server refused for good (retryable ones were retried by the SDK)
            raise SampleFailedError(failures)

    def server_stats(self) -> dict[str, float]:
        """Summed ``forward`` stage seconds and uptime of the servers (``/metrics``); empty unless all answer."""
        forward_s = uptime_s = 0.0
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        for url in self.urls:
            try:
                resp = self._http.get(url + "/metrics", headers=headers)
            except httpx.HTTPError:
                return {}
            if resp.status_code != 200:
                return {}
            found: dict[str, float] = {}
            for line in resp.text.splitlines():
                match = _METRIC_RE.match(line)
                if match:
                    key = "uptime" if match.group(1) == "eagle3_uptime_seconds" else "forward"
                    found[key] = found.get(key, 0.0) + float(match.group(2))
            if "uptime" not in found:
                return {}
            forward_s += found.get("forward", 0.0)
            uptime_s += found["uptime"]
        return {"server_forward_s": forward_s, "server_uptime_s": uptime_s}

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._http.close()
