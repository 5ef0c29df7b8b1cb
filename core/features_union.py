"""Several features directories of one model and one format, read as one.

A hybrid cache filled under ``torchrun`` (``eagle3 train --features-cache DIR``) is one directory per rank,
``DIR/rank-N``, because a features directory takes one writer (``core/features_writer.py`` locks it).
``open_features(DIR)`` reads such a cache, or a plain features directory, or a plain one with rank
directories beside its own shards, as one set of samples:

    features = open_features("cache/")      # FeaturesReader, or FeaturesUnion over DIR and DIR/rank-*
    features.sample_ids; features["sample-17"]; features.sample_n_tokens

Every directory must hold features of the same model (``ModelIdentity``) in the same format (dtype,
compression); a sample held by two directories (fetched twice across a restart with another world size)
is read from the first, in the order DIR, rank-0, rank-1, ...
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from eagle3.core.features_reader import FeaturesReader
from eagle3.core.protocol.features import FEATURES_META_FILE, FeaturesFormatError, FeaturesMeta
from eagle3.core.sample import ExtractedSample

RANK_DIR = re.compile(r"rank-(\d+)")


def rank_dir(features_dir: str | Path, rank: int) -> Path:
    """The directory rank ``rank`` of a torchrun run writes its share of a hybrid cache to."""
    return Path(features_dir) / f"rank-{rank}"


def rank_dirs(features_dir: str | Path) -> list[Path]:
    """The rank directories under ``features_dir`` that are features directories, in rank order."""
    root = Path(features_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := RANK_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found) if (p / FEATURES_META_FILE).is_file()]


def features_dirs(features_dir: str | Path) -> list[Path]:
    """``features_dir`` itself when it is a features directory, then its rank directories."""
    root = Path(features_dir)
    own = [root] if (root / FEATURES_META_FILE).is_file() else []
    return own + rank_dirs(root)


def same_features(meta: FeaturesMeta, other: FeaturesMeta, where: Path, reference: str) -> None:
    """Refuse ``other`` (the features of ``where``) unless it is ``meta``'s model in ``meta``'s format."""
    difference = meta.identity.diff(other.identity)
    if difference:
        raise FeaturesFormatError(
            f"{where} holds features of another model than {reference} ({difference}); one cache holds one "
            "model's features: move that directory away, or give this run a new cache directory"
        )
    if other.feature_format != meta.feature_format:
        raise FeaturesFormatError(
            f"{where} holds {other.feature_format} features, {reference} {meta.feature_format} "
            "(dtype/compression); one cache holds one format: give this run a new cache directory"
        )


class FeaturesUnion:
    """The samples of ``dirs`` (features directories), each read from the first directory holding it."""

    def __init__(self, dirs: Sequence[Path], *, verify: bool = False) -> None:
        if not dirs:
            raise FeaturesFormatError("no features directories to read")
        self.readers: list[FeaturesReader] = []
        try:
            for path in dirs:
                reader = FeaturesReader(path, verify=verify)
                self.readers.append(reader)
                same_features(self.readers[0].meta, reader.meta, path, str(dirs[0]))
        except BaseException:
            self.close()
            raise
        self.meta = self.readers[0].meta
        self.dirs = list(dirs)
        self._by_id: dict[str, int] = {}  # sample id -> index of the reader it is read from
        self._n_tokens: list[int] = []
        for r_index, reader in enumerate(self.readers):
            for sample_id, n in zip(reader.sample_ids, reader.sample_n_tokens, strict=True):
                if sample_id not in self._by_id:
                    self._by_id[sample_id] = r_index
                    self._n_tokens.append(n)
        self._ids = list(self._by_id)

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def sample_ids(self) -> list[str]:
        return list(self._ids)

    @property
    def sample_n_tokens(self) -> list[int]:
        return list(self._n_tokens)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._by_id

    def __iter__(self) -> Iterator[ExtractedSample]:
        for sample_id in self._ids:
            yield self[sample_id]

    def __getitem__(self, key: int | str) -> ExtractedSample:
        if isinstance(key, int):
            key = self._ids[key]
        if key not in self._by_id:
            raise KeyError(f"sample {key!r} is not in {', '.join(map(str, self.dirs))}")
        return self.readers[self._by_id[key]][key]

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


def open_features(features_dir: str | Path, *, verify: bool = False) -> FeaturesReader | FeaturesUnion:
    """A features directory's reader; a directory with rank directories (a torchrun hybrid cache) as one union.
    Every command that reads features opens them here (train, eval, convert, the notebook Dataset)."""
    dirs = features_dirs(features_dir)
    if dirs == [Path(features_dir)] or not dirs:
        return FeaturesReader(features_dir, verify=verify)  # not a features directory: its own error names it
    return FeaturesUnion(dirs, verify=verify)
