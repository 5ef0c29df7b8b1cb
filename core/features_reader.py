"""Read a features directory (``core/protocol/features.py``) without torch and without reading it all.

    reader = FeaturesReader("features/")
    len(reader); reader[0]; reader["sample-17"]; for s in reader: ...

Each shard is memory-mapped and its safetensors header parsed with ``eagle3.core.codec.parse_safetensors``;
a sample is a set of zero-copy views into the map (``ExtractedSample``, the type ``extract`` yields),
widened to float32 only when a float property is read (a compressed directory's states are
decompressed per sample when read, ``core/shard_states.py``; FP8 samples carry codes and scales).
Opening checks that every manifest shard exists with its recorded size and is of the directory's
format (``features.json``: a directory of mixed formats is refused, naming the shard and the fix);
``verify=True`` also hashes every file against the manifest.
"""

from __future__ import annotations

import json
import mmap
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.core.codec import RawTensor, parse_safetensors
from eagle3.core.protocol.features import (
    FEATURES_META_FILE,
    MANIFEST_FILE,
    SHARDS_DIR,
    FeaturesFormatError,
    FeaturesMeta,
    ShardRecord,
    iter_manifest,
    read_features_meta,
)
from eagle3.core.protocol.frames import ProtocolError
from eagle3.core.sample import ExtractedSample
from eagle3.core.shard_files import shard_checksum_ok
from eagle3.core.shard_states import check_blob_offsets, expected_tensors, sample_states

MAX_OPEN_SHARDS = 32


class FeaturesReader:
    def __init__(self, features_dir: str | Path, *, verify: bool = False) -> None:
        self.dir = Path(features_dir)
        self.meta: FeaturesMeta = read_features_meta(self.dir)
        self.records: list[ShardRecord] = list(iter_manifest(self.dir))
        self._where: list[tuple[int, int]] = []  # position -> (record index, sample index in shard)
        self._by_id: dict[str, int] = {}
        for r_index, record in enumerate(self.records):
            path = self.dir / SHARDS_DIR / record.shard
            if record.feature_format != self.meta.feature_format:
                raise FeaturesFormatError(
                    f"{self.dir}: mixed feature formats: shard {record.shard} is {record.feature_format} "
                    f"(dtype/compression), {FEATURES_META_FILE} says {self.meta.feature_format}; a directory "
                    "holds one format: move that shard's samples to a directory of their own format, or "
                    "re-extract into a new directory"
                )
            if not path.is_file() or path.stat().st_size != record.bytes:
                raise FeaturesFormatError(f"{path}: missing or not {record.bytes} bytes as {MANIFEST_FILE} says")
            if verify and not shard_checksum_ok(path, record):
                raise FeaturesFormatError(f"{path}: checksum differs from {MANIFEST_FILE} (corrupt shard)")
            for s_index, sample_id in enumerate(record.sample_ids):
                if sample_id in self._by_id:
                    raise FeaturesFormatError(f"{MANIFEST_FILE}: sample {sample_id!r} appears twice")
                self._by_id[sample_id] = len(self._where)
                self._where.append((r_index, s_index))
        self._open: OrderedDict[int, tuple[dict[str, RawTensor], Any]] = OrderedDict()
        self._open_lock = threading.Lock()  # the trainer's loader threads read samples at once

    def __len__(self) -> int:
        return len(self._where)

    @property
    def sample_ids(self) -> list[str]:
        return list(self._by_id)

    @property
    def n_tokens(self) -> int:
        return sum(sum(r.n_tokens) for r in self.records)

    @property
    def sample_n_tokens(self) -> list[int]:
        """Each sample's length in tokens, in ``sample_ids`` order."""
        return [n for record in self.records for n in record.n_tokens]

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._by_id

    def __iter__(self) -> Iterator[ExtractedSample]:
        for position in range(len(self)):
            yield self[position]

    def __getitem__(self, key: int | str) -> ExtractedSample:
        if isinstance(key, str):
            if key not in self._by_id:
                raise KeyError(f"sample {key!r} is not in {self.dir}")
            position = self._by_id[key]
        else:
            position = key + len(self) if key < 0 else key
            if not 0 <= position < len(self):
                raise IndexError(f"sample index {key} out of range ({len(self)} samples)")
        r_index, s_index = self._where[position]
        tensors, offsets = self._shard(r_index)
        start, end = int(offsets[s_index]), int(offsets[s_index + 1])
        path = self.dir / SHARDS_DIR / self.records[r_index].shard
        states, scales = sample_states(self.meta, path, tensors, s_index, start, end)
        return ExtractedSample(
            self.records[r_index].sample_ids[s_index],
            tensors["input_ids"].numpy()[start:end],
            tensors["loss_mask"].numpy()[start:end],
            states,  # bf16 bits [n, L, H] (memory-mapped unless compressed), or FP8 codes
            self.meta.aux_layer_ids,
            self.meta.final_layer_id,
            scales,
        )

    def _shard(self, r_index: int) -> tuple[dict[str, RawTensor], Any]:
        with self._open_lock:
            return self._open_shard(r_index)

    def _open_shard(self, r_index: int) -> tuple[dict[str, RawTensor], Any]:
        if r_index in self._open:
            self._open.move_to_end(r_index)
            return self._open[r_index]
        record = self.records[r_index]
        path = self.dir / SHARDS_DIR / record.shard
        with open(path, "rb") as fh:
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            tensors, metadata = parse_safetensors(memoryview(mapped))
        except ProtocolError as exc:
            raise FeaturesFormatError(f"{path}: not a valid shard ({exc})") from None
        self._check_shard(path, record, tensors, metadata)
        offsets = tensors["sample_offsets"].numpy()
        self._open[r_index] = (tensors, offsets)
        if len(self._open) > MAX_OPEN_SHARDS:
            self._open.popitem(last=False)  # the map closes once no sample view refers to it
        return tensors, offsets

    def _check_shard(
        self, path: Path, record: ShardRecord, tensors: dict[str, RawTensor], meta: dict[str, str]
    ) -> None:
        total = sum(record.n_tokens)
        want = {
            **expected_tensors(self.meta, total, len(record.sample_ids)),
            "input_ids": ("I32", (total,)),
            "loss_mask": ("U8", (total,)),
            "sample_offsets": ("I64", (len(record.sample_ids) + 1,)),
        }
        for name, (dtype, shape) in want.items():
            got = tensors.get(name)
            if got is None or got.dtype != dtype or got.shape != shape:
                raise FeaturesFormatError(f"{path}: {name} is not {dtype} {list(shape)}")
        check_blob_offsets(self.meta, path, tensors)
        offsets = tensors["sample_offsets"].numpy()
        if not np.array_equal(np.diff(offsets), record.n_tokens) or offsets[0] != 0:
            raise FeaturesFormatError(f"{path}: sample_offsets disagree with {MANIFEST_FILE}")
        if json.loads(meta.get("sample_ids", "[]")) != list(record.sample_ids):
            raise FeaturesFormatError(f"{path}: sample ids in the shard disagree with {MANIFEST_FILE}")

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> FeaturesReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
