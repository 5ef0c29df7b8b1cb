"""Rewrite a features directory in another format (``eagle3 convert FEATURES --to eagle3 --feature-dtype
fp8 --compress-shards --out NEW``): bf16 -> FP8 (quantized as the server would, ``core/fp8.py``), raw
<-> compressed at rest. FP8 -> bf16 is refused (the bits FP8 dropped do not come back). The source
is read sample by sample (memory-mapped) and the new directory written crash-safely by
``FeaturesWriter``; rerunning an interrupted conversion resumes it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eagle3.core.features_union import open_features
from eagle3.core.features_writer import DEFAULT_SHARD_MB, FeaturesWriter
from eagle3.core.protocol.features import CODEC_NONE, DTYPE_BF16, SHARD_CODECS, FeaturesFormatError


def convert_features(
    source: str | Path, out: str | Path, dtype: str, *, compress: bool = False, shard_mb: float = DEFAULT_SHARD_MB
) -> int:
    """Write every sample of ``source`` into ``out`` as ``dtype`` (``bfloat16`` or ``float8_e4m3fn``),
    compressed at rest when ``compress``; returns the samples written by this call."""
    if dtype not in SHARD_CODECS:
        raise FeaturesFormatError(f"feature dtype {dtype!r}: expected one of {', '.join(SHARD_CODECS)}")
    reader = open_features(source)
    if reader.meta.is_fp8 and dtype == DTYPE_BF16:
        raise FeaturesFormatError(
            f"{source} holds FP8 features; converting them to bfloat16 would not bring back what FP8 dropped: "
            "extract the data again (eagle3 extract) for lossless features"
        )
    meta = dataclasses.replace(reader.meta, dtype=dtype, shard_codec=SHARD_CODECS[dtype] if compress else CODEC_NONE)
    writer = FeaturesWriter.open(out, meta, shard_mb=shard_mb, background=True)
    n_written = 0
    try:
        for sample_id in reader.sample_ids:
            if sample_id not in writer.done_ids:
                writer.add(reader[sample_id])
                n_written += 1
        writer.close()
    finally:
        writer.release()
        reader.close()
    return n_written
