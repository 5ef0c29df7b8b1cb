"""PNG of a run's metrics: training loss (left) and per-step accuracy + held-out τ (right).

Drawn with Pillow (a vLLM/transformers dependency; matplotlib is not installed), so the plot is
plain: axes with min/max labels, one polyline per series, a legend.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

_W, _H, _PAD = 520, 360, 48
_COLORS = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
]


def _panel(draw: ImageDraw.ImageDraw, x0: int, title: str, series: dict[str, list[tuple[float, float]]]) -> None:
    points = [p for values in series.values() for p in values]
    if not points:
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_min, x_max, y_min, y_max = min(xs), max(xs), min(ys), max(ys)
    x_span, y_span = (x_max - x_min) or 1.0, (y_max - y_min) or 1.0
    left, top, right, bottom = x0 + _PAD, _PAD // 2 + 12, x0 + _W - 12, _H - _PAD
    draw.rectangle([left, top, right, bottom], outline=(0, 0, 0))
    draw.text((left, 4), title, fill=(0, 0, 0))
    draw.text((left - 44, top), f"{y_max:.3g}", fill=(0, 0, 0))
    draw.text((left - 44, bottom - 10), f"{y_min:.3g}", fill=(0, 0, 0))
    draw.text((left, bottom + 4), f"step {x_min:.0f}", fill=(0, 0, 0))
    draw.text((right - 70, bottom + 4), f"step {x_max:.0f}", fill=(0, 0, 0))

    def to_px(x: float, y: float) -> tuple[float, float]:
        return left + (x - x_min) / x_span * (right - left), bottom - (y - y_min) / y_span * (bottom - top)

    for i, (name, values) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        if len(values) > 1:
            draw.line([to_px(x, y) for x, y in values], fill=color, width=2)
        elif values:
            px, py = to_px(*values[0])
            draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=color)
        draw.text((left + 8 + 90 * (i % 5), bottom + 18 + 12 * (i // 5)), name, fill=color)


def plot_metrics(metrics_path: Path, out_path: Path) -> Path:
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    loss = {"loss": [(r["step"], r["loss"]) for r in train]}
    n_steps = len(train[0]["acc"]) if train else 0
    acc: dict[str, list[tuple[float, float]]] = {
        f"acc step {k}": [(r["step"], r["acc"][k]) for r in train] for k in range(n_steps)
    }
    held = [r for r in records if "heldout_sim_accept" in r]
    if held:
        acc["held-out accept"] = [(r["step"], r["heldout_sim_accept"] / max(1, n_steps)) for r in held]
    image = Image.new("RGB", (2 * _W, _H), "white")
    draw = ImageDraw.Draw(image)
    _panel(draw, 0, "training loss (TTT, decayed sum)", loss)
    _panel(draw, _W, "per-step accuracy (train); held-out accept / K", acc)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    image.save(tmp, format="PNG")
    tmp.replace(out_path)
    return out_path
