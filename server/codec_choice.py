"""Codec ``auto`` (the default): compress only when the link, not the encoder, is the limit.

Every codec is lossless, so the choice is about speed only. zstd+planes sends ~0.7 of the raw bytes
but encodes at roughly 0.1-0.5 GB/s per core; a loopback or same-host connection moves several GB/s.
Compressing there makes the encoder the bottleneck (measured: docs/performance.md, "Serving path").

Rule, per request:

* the peer is this host (a loopback address or one of the host's own addresses): ``none``;
* else ``zstd+planes`` when the encoder pool's measured rate (``encode_mb_s_per_core`` x encoder
  threads) is at least ``link_mb_s`` (the operator's figure for the network, ``--link-mb-s``, default
  10 Gb/s = 1250 MB/s); ``none`` otherwise (the encoder would be slower than the wire).

``encode_mb_s_per_core`` is measured once at load on 8 MiB of bf16 N(0, 3) activations (one thread).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import time

import numpy as np

from eagle3.core.codec import encode_payload
from eagle3.core.protocol.frames import CODEC_NAMES, Codec
from eagle3.core.protocol.wire import AUTO_CODEC, REQUEST_CODECS

AUTO = AUTO_CODEC
CODEC_CHOICES = REQUEST_CODECS  # the request-level names (wire names + auto): eagle3.core.protocol.wire
AUTO_COMPRESSED = Codec.ZSTD_PLANES
PROBE_BYTES = 8 << 20


def measure_encode_mb_s(codec: Codec = AUTO_COMPRESSED, level: int = 1, min_s: float = 0.2) -> float:
    """One thread's encode rate in MB/s of raw bytes, on bf16 bits of N(0, 3) (like real activations)."""
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(PROBE_BYTES // 2, dtype=np.float32) * 3.0).view(np.uint32)
    blob = (values >> 16).astype(np.uint16).tobytes()  # bf16 bit patterns (truncated)
    encode_payload(blob, codec, level)  # first call: contexts, page faults
    n, started = 0, time.perf_counter()
    while True:
        encode_payload(blob, codec, level)
        n += 1
        elapsed_s = time.perf_counter() - started
        if elapsed_s >= min_s:
            return n * len(blob) / elapsed_s / 1e6


@functools.lru_cache(maxsize=1)
def local_addresses() -> frozenset[str]:
    """This host's own IP addresses (best effort: the host name's addresses and the default route's)."""
    found: set[str] = set()
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            found.add(str(info[4][0]))
    except OSError:
        pass
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((probe, 9))  # UDP connect sends nothing: it only picks the route's address
                found.add(str(sock.getsockname()[0]))
        except OSError:
            pass
    return frozenset(found)


def same_host(peer: str | None) -> bool:
    if not peer:
        return False
    try:
        if ipaddress.ip_address(peer).is_loopback:
            return True
    except ValueError:
        return peer == "testclient"  # starlette's in-process TestClient
    return peer in local_addresses()


def choose_codec(
    name: str, peer: str | None, encode_mb_s_per_core: float, encoder_threads: int, link_mb_s: float
) -> Codec:
    """The codec a request gets: an explicit name as is; ``auto`` by the module's rule."""
    if name != AUTO:
        return CODEC_NAMES[name]
    if same_host(peer):
        return Codec.NONE
    return AUTO_COMPRESSED if encode_mb_s_per_core * encoder_threads >= link_mb_s else Codec.NONE
