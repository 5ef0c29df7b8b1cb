"""PNG of a run's metrics: training loss, per-step accuracy, held-out τ and, per epoch, the share of the
wall time spent waiting for data and the servers' idle share when streamed (fourth panel).

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
    (23, 190, 207),
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
        draw.text((left + 8 + 62 * (i % 8), bottom + 18 + 12 * (i // 8)), name, fill=color)


def _smooth(values: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """Trailing moving average over ``window`` points (per-batch metrics are noisy)."""
    out, total = [], 0.0
    for i, (x, y) in enumerate(values):
        total += y - (values[i - window][1] if i >= window else 0.0)
        out.append((x, total / min(i + 1, window)))
    return out


def plot_metrics(metrics_path: Path, out_path: Path) -> Path:
    """Train loss and per-step accuracy (moving average over ~2% of the steps, steps without supervised
    tokens skipped), the held-out per-step accuracy ("held k") and the held-out τ ("held tau") of the
    evaluations in the log (every epoch by default, and the final one)."""
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r and r.get("tokens", 1) > 0]
    window = max(1, len(train) // 50)
    loss = {"loss": _smooth([(r["step"], r["loss"]) for r in train], window)}
    n_steps = len(train[0]["acc"]) if train else 0
    acc: dict[str, list[tuple[float, float]]] = {
        f"train {k}": _smooth([(r["step"], r["acc"][k]) for r in train], window) for k in range(n_steps)
    }
    held = [r for r in records if "heldout_acc" in r]
    for k in range(n_steps if held else 0):
        acc[f"held {k}"] = [(r["step"], r["heldout_acc"][k]) for r in held]
    tau = {"held tau": [(r["step"], r["heldout_tau"]) for r in held if "heldout_tau" in r]}
    epochs = [r for r in records if "data_wait_share" in r]  # the data wait per epoch (streamed or not)
    shares = {"data wait": [(r["step"], r["data_wait_share"]) for r in epochs]}
    if any("server_idle_share" in r for r in epochs):
        shares["server idle"] = [(r["step"], r["server_idle_share"]) for r in epochs if "server_idle_share" in r]
    image = Image.new("RGB", ((4 if epochs else 3) * _W, _H), "white")
    draw = ImageDraw.Draw(image)
    _panel(draw, 0, "training loss (TTT, decayed sum)", loss)
    _panel(draw, _W, "per-step accuracy: train (moving avg), held-out", acc)
    _panel(draw, 2 * _W, "held-out tau (online rounds replayed; every epoch)", tau)
    if epochs:
        _panel(draw, 3 * _W, "per epoch: share of wall time waiting for data, server idle", shares)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    image.save(tmp, format="PNG")
    tmp.replace(out_path)
    return out_path
