"""Codec ``auto``: none to this host, zstd+planes only when the encoder pool outruns the link."""

from __future__ import annotations

from eagle3.core.protocol.frames import Codec
from eagle3.server.codec_choice import choose_codec, local_addresses, measure_encode_mb_s, same_host


def test_explicit_codecs_pass_through_and_auto_follows_the_rule():
    assert choose_codec("zstd", "127.0.0.1", 1.0, 1, 1250.0) == Codec.ZSTD
    assert choose_codec("none", "10.9.9.9", 1e6, 64, 1.0) == Codec.NONE
    for peer in ("127.0.0.1", "::1", "testclient", *local_addresses()):
        assert same_host(peer) and choose_codec("auto", peer, 1e6, 64, 1.0) == Codec.NONE
    remote = "203.0.113.7"  # TEST-NET-3: never this host
    assert not same_host(remote) and not same_host(None)
    assert choose_codec("auto", remote, 500.0, 16, 1250.0) == Codec.ZSTD_PLANES  # 8 GB/s of encoders > link
    assert choose_codec("auto", remote, 100.0, 2, 1250.0) == Codec.NONE  # encoders slower than the link


def test_the_encode_probe_measures_a_real_rate():
    rate = measure_encode_mb_s(min_s=0.05)
    assert 1.0 < rate < 100_000.0
