"""curve.svg of `zplan plan -o OUT`: train time (days) against GPUs, both on log scales (ideal scaling is a straight
line), each count's 80 % interval as a bar, the deadline dashed and the chosen count ringed. A standalone SVG file,
drawn with codegen/svg_charts.py's marks."""

from __future__ import annotations

from math import ceil, floor, log2, log10

from zplan.codegen.svg_charts import ALERT, GRID, INK, MUTED, _line, _n, _svg, _text, _title

BOX = (80.0, 920.0, 30.0, 330.0)  # left, right, top, bottom of the plot, px
LINE = "#4e79a7"


def _log_ticks(low: float, high: float) -> list[float]:
    """1, 2 and 5 times the powers of ten from below `low` to above `high` (both > 0)."""
    ticks = []
    for exponent in range(floor(log10(low)), ceil(log10(high)) + 1):
        ticks += [m * 10.0 ** exponent for m in (1, 2, 5)]
    inside = [t for t in ticks if low <= t <= high]
    below = [t for t in ticks if t < low][-1:]
    above = [t for t in ticks if t > high][:1]
    return below + inside + above


def curve_svg(curve: dict) -> str:
    """The chart of curve.json's rows that have a plan (a count without one is listed in curve.md)."""
    left, right, top, bottom = BOX
    rows = [r for r in curve["curve"] if r["days"] is not None]
    deadline = curve["deadline_days"]
    days = [deadline] + [d for r in rows for d in (r["days_interval"] or [r["days"]])]
    y_ticks = _log_ticks(min(days), max(days))
    gpus = [r["gpus"] for r in rows] or [1]
    x_low, x_high = floor(log2(min(gpus))), max(ceil(log2(max(gpus))), floor(log2(min(gpus))) + 1)

    def to_x(count: float) -> float:
        return left + (log2(count) - x_low) / (x_high - x_low) * (right - left)

    def to_y(value: float) -> float:
        span = log10(y_ticks[-1]) - log10(y_ticks[0])
        return bottom - (log10(value) - log10(y_ticks[0])) / span * (bottom - top)

    body = []
    for power in range(x_low, x_high + 1):
        body.append(_line(to_x(2 ** power), top, to_x(2 ** power), bottom, GRID))
        body.append(_text(to_x(2 ** power), bottom + 18, f"{2 ** power:g}", "middle", 11, MUTED))
    for tick in y_ticks:
        body.append(_line(left, to_y(tick), right, to_y(tick), GRID))
        body.append(_text(left - 8, to_y(tick) + 4, f"{tick:g}", "end", 11, MUTED))
    body.append(_text((left + right) / 2, bottom + 38, "GPUs", "middle", 12, MUTED))
    middle = _n((top + bottom) / 2)
    body.append(f'<text x="18" y="{middle}" text-anchor="middle" font-size="12" fill="{MUTED}" '
                f'transform="rotate(-90 18 {middle})">train time (days)</text>')
    body.append(_line(left, to_y(deadline), right, to_y(deadline), ALERT, "5 3", 1.5))
    body.append(_text(right - 6, to_y(deadline) - 6, f"deadline {deadline:g} days", "end", 11, ALERT))
    if len(rows) > 1:
        path = " ".join(f"{'M' if i == 0 else 'L'}{_n(to_x(r['gpus']))},{_n(to_y(r['days']))}"
                        for i, r in enumerate(rows))
        body.append(f'<path d="{path}" fill="none" stroke="{LINE}" stroke-width="2" stroke-opacity="0.6"/>')
    chosen = curve["chosen"]["gpus"] if curve["chosen"] is not None else None
    for r in rows:
        x, y = to_x(r["gpus"]), to_y(r["days"])
        if r["days_interval"] is not None:
            body.append(_line(x, to_y(r["days_interval"][0]), x, to_y(r["days_interval"][1]), LINE, width=2))
        cost = f", cost {r['cost']:,.0f}" if r["cost"] is not None else ""
        tip = f"{r['gpus']} GPUs: {r['days']:,.1f} days, {r['gpu_hours']:,.0f} GPU-hours{cost}"
        style = (f'r="8" fill="#2f5d8a" stroke="{INK}" stroke-width="2.5"' if r["gpus"] == chosen else
                 f'r="5" fill="{LINE}"' if r["meets"] else f'r="5" fill="#ffffff" stroke="{LINE}" stroke-width="1.5"')
        body.append(f'<circle cx="{_n(x)}" cy="{_n(y)}" {style}>{_title(tip)}</circle>')
        if r["gpus"] == chosen:
            text = f"chosen: {r['gpus']} GPUs"
            anchor, label_x = ("start", x + 12) if x + 12 + len(text) * 7.2 <= right else ("end", x - 12)
            body.append(_text(label_x, y - 8, text, anchor, 12, weight="600", halo=True))
    label = "Train time against GPUs: filled points meet the deadline, bars are the 80 % intervals"
    body.append(_text(left, bottom + 62, label, size=11, fill=MUTED))
    return str(_svg("chart-curve", bottom + 76, "Train time (days) against GPUs", body))
