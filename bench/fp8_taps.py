"""Which stored layer FP8 costs acceptance on: a lossless features directory with FP8's rounding applied to
some layers only, still stored as bf16, for a training run beside the lossless and the all-FP8 ones.

``--layers aux``: the draft's inputs (every tap but the last) quantized to e4m3 with the per-token, per-layer
scale and back (``core/fp8.py``, as the server quantizes), the final state (the teacher's) exact: what a
format keeping the final state in bf16 would train on, before building that format. ``--layers final``:
the other way round. The values are rounded to bf16 after dequantizing (3 mantissa bits of e4m3 times a
float32 scale need up to 24): a relative change of at most 2^-9, against e4m3's 2^-4.

    python -m bench.fp8_taps FEATURES --layers aux --out FEATURES_AUX8
    eagle3 train --features FEATURES_AUX8 ...  # then export, eval as docs/draft-quality.md's FP8 pair

Prints JSON: samples written, tokens, the layers quantized, the mean relative change of those layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from eagle3.core.codec import bf16_to_float32
from eagle3.core.features_reader import FeaturesReader
from eagle3.core.features_writer import FeaturesWriter
from eagle3.core.fp8 import dequantize_states, float32_to_bf16_bits, quantize_states


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("features", type=Path)
    p.add_argument("--layers", choices=("aux", "final"), required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    reader = FeaturesReader(args.features)
    if reader.meta.is_fp8:
        raise SystemExit(f"{args.features} is FP8 already: give a lossless (bf16) features directory")
    n_layers = reader.meta.n_layers_stored
    chosen = list(range(n_layers - 1)) if args.layers == "aux" else [n_layers - 1]
    writer = FeaturesWriter.open(args.out, reader.meta, background=True)
    n_tokens, change_sum, change_n = 0, 0.0, 0
    try:
        for sample_id in reader.sample_ids:
            sample = reader[sample_id]
            bits = np.array(sample.states)  # uint16 [n, L, H]
            exact = bf16_to_float32(bits[:, chosen])
            codes, scales = quantize_states(exact)
            rounded = float32_to_bf16_bits(dequantize_states(codes, scales))
            bits[:, chosen] = rounded
            change = np.abs(bf16_to_float32(rounded) - exact).sum(-1) / np.maximum(np.abs(exact).sum(-1), 1e-30)
            change_sum, change_n = change_sum + float(change.sum()), change_n + change.size
            n_tokens += bits.shape[0]
            if sample_id not in writer.done_ids:
                writer.add(dataclasses.replace(sample, states=bits))
        writer.close()
    finally:
        writer.release()
        reader.close()
    print(json.dumps({"samples": len(reader.sample_ids), "tokens": n_tokens, "layers": chosen,
                      "mean_relative_l1_change": change_sum / max(1, change_n)}))  # fmt: skip


if __name__ == "__main__":
    main()
