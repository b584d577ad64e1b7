"""Inline SVG for report.html, drawn from the chart data of codegen/report.py.

Server-side and script-free, so the report opens offline and renders the same everywhere. Every
drawn mark carries a <title> (the browser's tooltip). Coordinates are written with one decimal, so
the same plan always gives the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from html import escape
from math import ceil, floor, log10

from markupsafe import Markup

from zplan.codegen.context import GiB, format_bytes, format_seconds
from zplan.codegen.report import MemoryChart, ParetoChart, ParetoPoint, PipelineTimeline, TimeChart
from zplan.schemas.inference import ContinuousBatchingPrediction

WIDTH = 960
FONT = 12
INK, MUTED, GRID, TRACK, ALERT = "#1f2933", "#616e7c", "#e4e7eb", "#f0f2f5", "#d64545"

MEMORY_COLORS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#e15759",
                 "activations": "#76b7b2", "comm_buffers": "#59a14f", "reserve": "#bab0ac"}
TIME_COLORS = {"compute": "#4e79a7", "tensor_parallel": "#f28e2b", "context_parallel": "#ff9da7",
               "expert_parallel": "#8cd17d",
               "pipeline_bubble": "#e15759",
               "pipeline_p2p": "#edc948", "data_parallel": "#59a14f", "offload": "#b07aa1",
               "optimizer": "#9c755f"}
# (forward, backward) colour per model chunk, cycling.
CHUNK_COLORS = (("#4e79a7", "#f28e2b"), ("#a0cbe8", "#ffbe7d"), ("#2f5d8a", "#c4661a"),
                ("#c5dcef", "#ffd8b0"))


def _n(value: float) -> str:
    """A coordinate: one decimal, no trailing '.0', no '-0'."""
    text = f"{value:.1f}".removesuffix(".0")
    return "0" if text == "-0" else text


def _title(text: str) -> str:
    return f"<title>{escape(text)}</title>"


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "", extra: str = "") -> str:
    body = _title(title) if title else ""
    return (f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(max(w, 0))}" height="{_n(h)}" fill="{fill}"{extra}>'
            f"{body}</rect>")


def _text(x: float, y: float, text: str, anchor: str = "start", size: int = FONT, fill: str = INK,
          weight: str = "normal", halo: bool = False) -> str:
    """A label; `halo` outlines it in white so it stays readable over marks."""
    outline = ' stroke="#ffffff" stroke-width="3" paint-order="stroke"' if halo else ""
    return (f'<text x="{_n(x)}" y="{_n(y)}" text-anchor="{anchor}" font-size="{size}" fill="{fill}"'
            f' font-weight="{weight}"{outline}>{escape(text)}</text>')


def _line(x1: float, y1: float, x2: float, y2: float, stroke: str, dash: str = "", width: float = 1) -> str:
    dashes = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<line x1="{_n(x1)}" y1="{_n(y1)}" x2="{_n(x2)}" y2="{_n(y2)}" stroke="{stroke}"'
            f' stroke-width="{_n(width)}"{dashes}/>')


def _svg(chart_id: str, height: float, label: str, body: list[str], namespace: bool = True) -> Markup:
    """The chart's <svg> element; `namespace` False leaves out xmlns, which SVG inline in HTML5 does not need (the
    inference report holds no URL)."""
    xmlns = 'xmlns="http://www.w3.org/2000/svg" ' if namespace else ""
    return Markup(
        f'<svg id="{chart_id}" class="chart" viewBox="0 0 {WIDTH} {_n(height)}" role="img" '
        f'aria-label="{escape(label)}" {xmlns}'
        f'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif">'
        + "".join(body) + "</svg>"
    )


def nice_ticks(low: float, high: float, count: int = 5, integer: bool = False) -> list[float]:
    """Round tick values covering [low, high]: steps of 1, 2 or 5 times a power of ten."""
    if high <= low:
        high = low + (abs(low) * 0.1 or 1)
    raw_step = (high - low) / count
    magnitude = 10 ** floor(log10(raw_step))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw_step)
    if integer:
        step = max(step, 1)
    first = floor(low / step) * step
    ticks, value = [], first
    while value < high + step * 0.999:
        ticks.append(round(value, 12))
        value += step
    return ticks


def _tick_label(value: float) -> str:
    return f"{value:g}"


def _legend(x: float, y: float, items: list[tuple[str, str]]) -> tuple[list[str], float]:
    """Swatches and labels in rows; returns the marks and the y below the legend."""
    marks, cursor_x, cursor_y = [], x, y
    for color, label in items:
        item_width = 22 + len(label) * 6.6 + 18
        if cursor_x + item_width > WIDTH - 20 and cursor_x > x:
            cursor_x, cursor_y = x, cursor_y + 20
        marks.append(_rect(cursor_x, cursor_y - 10, 12, 12, color, label, ' rx="2"'))
        marks.append(_text(cursor_x + 18, cursor_y, label, fill=INK))
        cursor_x += item_width
    return marks, cursor_y + 14


def memory_svg(chart: MemoryChart) -> Markup:
    """One stacked bar (bytes per GPU on the most loaded stage) against the device capacity."""
    left, right, bar_y, bar_h = 20, WIDTH - 20, 44, 46
    scale_max = max(chart.capacity_bytes, chart.total_bytes) * 1.04
    scale = (right - left) / scale_max if scale_max else 0
    body = [_rect(left, bar_y, chart.capacity_bytes * scale, bar_h, TRACK, "Free device memory", ' rx="3"')]
    x = left
    for segment in chart.segments:
        width = segment.value * scale
        body.append(_rect(x, bar_y, width, bar_h, MEMORY_COLORS[segment.key],
                          f"{segment.label}: {segment.display} ({segment.percent} of capacity)"))
        if width > 64:
            body.append(_text(x + width / 2, bar_y + bar_h / 2 + 4, segment.display, "middle", 11, "#ffffff"))
        x += width
    capacity_x = left + chart.capacity_bytes * scale
    body.append(_line(capacity_x, bar_y - 14, capacity_x, bar_y + bar_h + 6, ALERT, "5 3", 2))
    capacity_label = f"capacity {format_bytes(chart.capacity_bytes)}"
    body.append(_text(capacity_x, bar_y - 18, capacity_label, "end", 12, ALERT))
    body.append(_text(left, bar_y - 18, f"used {format_bytes(chart.total_bytes)} per GPU", weight="600"))
    axis_y = bar_y + bar_h + 8
    for tick in nice_ticks(0, scale_max / GiB, 8):
        tick_x = left + tick * GiB * scale
        if tick_x <= right:
            body.append(_line(tick_x, axis_y, tick_x, axis_y + 5, MUTED))
            body.append(_text(tick_x, axis_y + 18, _tick_label(tick), "middle", 11, MUTED))
    body.append(_text(right, axis_y + 34, "GiB per GPU", "end", 11, MUTED))
    legend, bottom = _legend(left, axis_y + 56, [(MEMORY_COLORS[s.key], f"{s.label} {s.display}")
                                                 for s in chart.segments])
    return _svg("chart-memory", bottom + 6, "Memory per GPU against capacity", body + legend)


def time_svg(chart: TimeChart) -> Markup:
    """The step as one stacked bar, then one bar per part on a shared scale."""
    left, right, label_w = 20, WIDTH - 20, 290
    body = [_text(left, 18, f"step {format_seconds(chart.step_time_s)}", weight="600")]
    total = sum(segment.value for segment in chart.segments) or 1.0
    x, bar_w = left, right - left
    for segment in chart.segments:
        width = segment.value / total * bar_w
        body.append(_rect(x, 28, width, 26, TIME_COLORS[segment.key],
                          f"{segment.label}: {segment.display} ({segment.percent} of the step)"))
        x += width
    largest = max((segment.value for segment in chart.segments), default=0.0) or 1.0
    plot_left, plot_w, row_y = left + label_w, right - left - label_w - 150, 78
    for segment in chart.segments:
        tooltip = f"{segment.label}: {segment.display} ({segment.percent} of the step)"
        body.append(_text(plot_left - 10, row_y + 13, segment.label, "end", 12))
        body.append(_rect(plot_left, row_y, plot_w, 18, TRACK, tooltip, ' rx="2"'))
        body.append(_rect(plot_left, row_y, segment.value / largest * plot_w, 18, TIME_COLORS[segment.key],
                          tooltip, ' rx="2"'))
        value_label = f"{segment.display} \u00b7 {segment.percent}"
        body.append(_text(plot_left + plot_w + 10, row_y + 13, value_label, size=12, fill=MUTED))
        row_y += 28
    return _svg("chart-time", row_y + 6, "Time per step by part", body)


def pipeline_svg(timeline: PipelineTimeline) -> Markup:
    """Per pipeline rank, the forward and backward slots of the drawn micro-batches."""
    left, right, label_w = 20, WIDTH - 20, 64
    row_h = 22 if timeline.stages <= 16 else max(6, 352 // timeline.stages)
    plot_left, plot_w, top = left + label_w, right - left - label_w, 12
    units = max(timeline.total_units, 1)
    unit_w = min(plot_w / units, 48.0)  # a short schedule stays readable instead of stretching
    label_every = ceil(16 / row_h)  # a rank label needs ~16 px of height
    # A kind of slot (forward or backward) is numbered only if every slot of that kind has room for its
    # number, so a row never shows some micro-batches numbered and others not.
    digits = len(str(max((slot.micro_batch for slot in timeline.slots), default=0)))
    narrowest = {kind: min(slot.duration for slot in timeline.slots if slot.kind == kind)
                 for kind in {slot.kind for slot in timeline.slots}}
    numbered = {kind for kind, units in narrowest.items() if units * unit_w >= 6 * digits + 6 and row_h >= 14}
    body = []
    for stage in range(timeline.stages):
        y = top + stage * row_h
        idle = f"rank {stage}: idle where empty"
        body.append(_rect(plot_left, y + 1, units * unit_w, row_h - 2, TRACK, idle))
        if stage % label_every == 0:
            body.append(_text(plot_left - 8, y + row_h / 2 + 4, f"rank {stage}", "end", 11, MUTED))
    for slot in timeline.slots:
        forward_color, backward_color = CHUNK_COLORS[slot.chunk % len(CHUNK_COLORS)]
        x, y = plot_left + slot.start * unit_w, top + slot.stage * row_h
        width = slot.duration * unit_w
        kind = "forward" if slot.kind == "F" else "backward"
        chunk = f", chunk {slot.chunk}" if timeline.chunks > 1 else ""
        tooltip = (f"rank {slot.stage}: {kind} of micro-batch {slot.micro_batch}{chunk}, "
                   f"units {slot.start}-{slot.start + slot.duration}")
        body.append(_rect(x + 0.5, y + 1, width - 1, row_h - 2,
                          forward_color if slot.kind == "F" else backward_color, tooltip))
        if slot.kind in numbered:
            body.append(_text(x + width / 2, y + row_h / 2 + 4, str(slot.micro_batch), "middle", 10, "#ffffff"))
    axis_y = top + timeline.stages * row_h + 4
    for tick in nice_ticks(0, units, 10, integer=True):
        if tick <= units:
            tick_x = plot_left + tick * unit_w
            body.append(_line(tick_x, axis_y, tick_x, axis_y + 5, MUTED))
            body.append(_text(tick_x, axis_y + 17, _tick_label(tick), "middle", 11, MUTED))
    if numbered == {"F", "B"}:
        numbers = "; the number in a slot is its micro-batch"
    elif numbered:
        numbers = f"; the number in a {'forward' if 'F' in numbered else 'backward'} slot is its micro-batch"
    else:
        numbers = "; hover a slot for its micro-batch"
    caption = f"time (units: forward of one model chunk = 1, backward = 2){numbers}"
    body.append(_text(plot_left, axis_y + 32, caption, "start", 11, MUTED))
    items = []
    for chunk in range(timeline.chunks):
        forward_color, backward_color = CHUNK_COLORS[chunk % len(CHUNK_COLORS)]
        suffix = f" (chunk {chunk})" if timeline.chunks > 1 else ""
        items += [(forward_color, f"forward{suffix}"), (backward_color, f"backward{suffix}")]
    legend, bottom = _legend(left, axis_y + 52, items)
    return _svg("chart-pipeline", bottom + 4, "Pipeline schedule timeline", body + legend)


# The Pareto chart's view: memory up to this many times the device capacity (or the largest feasible
# point), step time up to this many times the chosen plan's (or the slowest point on the front).
VIEW_CAPACITY_FACTOR = 2.0
VIEW_TIME_FACTOR = 3.0
PARETO_BOX = (78, WIDTH - 30, 20, 360)  # left, right, top, bottom of the plot area


@dataclass(frozen=True)
class ParetoView:
    """The axes of the Pareto chart and the points that lie beyond them."""

    x_ticks: list[float]  # GiB per GPU
    y_ticks: list[float]  # step time, in time_unit
    time_scale: float  # seconds -> time_unit
    time_unit: str
    capacity_in_view: bool
    off_chart: list[ParetoPoint]  # drawn clipped at the edge of the plot

    @property
    def x_max_gib(self) -> float:
        return self.x_ticks[-1]

    @property
    def y_max_s(self) -> float:
        return self.y_ticks[-1] / self.time_scale

    def beyond(self, point: ParetoPoint) -> tuple[bool, bool]:
        """(past the right edge, past the top edge)."""
        return point.memory_bytes / GiB > self.x_max_gib, point.step_time_s > self.y_max_s


def pareto_view(chart: ParetoChart) -> ParetoView:
    """Axes that show the region that matters: every feasible point, the chosen plan and the Pareto front.

    Memory goes up to VIEW_CAPACITY_FACTOR x the device capacity (further if a feasible point or the
    chosen plan needs it), step time up to VIEW_TIME_FACTOR x the chosen plan's (further if the front
    needs it); a point beyond either is listed in off_chart and drawn at the edge."""
    capacity_gib = chart.capacity_bytes / GiB
    points = chart.points
    memories = [p.memory_bytes / GiB for p in points] or [capacity_gib]
    times = [p.step_time_s for p in points] or [1.0]
    kept = [p for p in points if p.feasible or p.chosen]
    x_needed = max([p.memory_bytes / GiB for p in kept] + [VIEW_CAPACITY_FACTOR * capacity_gib])
    x_high = min(max(memories), x_needed)
    y_needed = max([p.step_time_s for p in points if p.on_front or p.chosen]
                   + [VIEW_TIME_FACTOR * p.step_time_s for p in points if p.chosen], default=max(times))
    y_high = min(max(times), y_needed)
    capacity_in_view = x_high >= capacity_gib / 2  # else it would squash the points
    if capacity_in_view:
        x_high = max(x_high, capacity_gib)
    x_low = min(min(memories), capacity_gib) if capacity_in_view else min(memories)
    time_scale, time_unit = (1.0, "s") if y_high >= 1 else (1e3, "ms")
    x_ticks = nice_ticks(x_low * 0.95, x_high * 1.03, 8)
    y_ticks = nice_ticks(min(times) * time_scale * 0.95, y_high * time_scale * 1.03, 6)
    view = ParetoView(x_ticks=x_ticks, y_ticks=y_ticks, time_scale=time_scale, time_unit=time_unit,
                      capacity_in_view=capacity_in_view, off_chart=[])
    return replace(view, off_chart=[p for p in points if any(view.beyond(p))])


def _arrow(x: float, y: float, right: bool, up: bool, size: float = 7) -> str:
    """Points of a triangle at (x, y) pointing right, up, or up-right (where the point really is)."""
    dx, dy = (1.0 if right else 0.0), (-1.0 if up else 0.0)
    norm = (dx * dx + dy * dy) ** 0.5 or 1.0
    dx, dy = dx / norm, dy / norm
    px, py = -dy, dx  # perpendicular
    tip = (x + dx * size * 0.5, y + dy * size * 0.5)
    base = (x - dx * size * 0.9, y - dy * size * 0.9)
    corners = [tip, (base[0] + px * size * 0.75, base[1] + py * size * 0.75),
               (base[0] - px * size * 0.75, base[1] - py * size * 0.75)]
    return " ".join(f"{_n(cx)},{_n(cy)}" for cx, cy in corners)


def _point_style(point: ParetoPoint) -> str:
    if point.chosen:
        return f'fill="#2f5d8a" stroke="{INK}" stroke-width="2.5"'
    if point.on_front:
        return 'fill="#4e79a7" stroke="#ffffff" stroke-width="1"'
    if point.feasible:
        return 'fill="#9aa5b1" fill-opacity="0.8"'
    return f'fill="#ffffff" stroke="{ALERT}" stroke-width="1.5"'


def pareto_svg(chart: ParetoChart) -> Markup:
    """Step time against memory per GPU; the Pareto front joined by a line, the chosen plan ringed.

    Points beyond the view (pareto_view) are drawn as triangles on the edge, pointing where they lie."""
    left, right, top, bottom = PARETO_BOX
    view = pareto_view(chart)
    x_ticks, y_ticks, time_scale = view.x_ticks, view.y_ticks, view.time_scale
    capacity_gib = chart.capacity_bytes / GiB

    def to_x(gib: float) -> float:
        gib = min(gib, x_ticks[-1])
        return left + (gib - x_ticks[0]) / (x_ticks[-1] - x_ticks[0]) * (right - left)

    def to_y(seconds: float) -> float:
        value = min(seconds * time_scale, y_ticks[-1])
        return bottom - (value - y_ticks[0]) / (y_ticks[-1] - y_ticks[0]) * (bottom - top)

    body = []
    for tick in x_ticks:
        body.append(_line(to_x(tick), top, to_x(tick), bottom, GRID))
        body.append(_text(to_x(tick), bottom + 18, _tick_label(tick), "middle", 11, MUTED))
    for tick in y_ticks:
        body.append(_line(left, to_y(tick / time_scale), right, to_y(tick / time_scale), GRID))
        body.append(_text(left - 8, to_y(tick / time_scale) + 4, _tick_label(tick), "end", 11, MUTED))
    body.append(_text((left + right) / 2, bottom + 38, "memory per GPU (GiB)", "middle", 12, MUTED))
    middle = _n((top + bottom) / 2)
    body.append(f'<text x="18" y="{middle}" text-anchor="middle" font-size="12" fill="{MUTED}" '
                f'transform="rotate(-90 18 {middle})">step time ({view.time_unit})</text>')
    if view.capacity_in_view:
        capacity_x = to_x(capacity_gib)
        label = f"device capacity {format_bytes(chart.capacity_bytes)}"
        body.append(_line(capacity_x, top, capacity_x, bottom, ALERT, "5 3", 1.5))
        label_y = top + 28  # below the triangles of points beyond the top edge
        if capacity_x - 6 - _text_width(label, 11) >= left + 4:  # room on the left of the line
            body.append(_text(capacity_x - 6, label_y, label, "end", 11, ALERT, halo=True))
        else:
            body.append(_text(capacity_x + 6, label_y, label, "start", 11, ALERT, halo=True))
    else:
        off_scale = f"device capacity {format_bytes(chart.capacity_bytes)} (off scale)"
        body.append(_text(right - 6, top + 12, off_scale, "end", 11, ALERT))
    front = sorted((p for p in chart.points if p.on_front), key=lambda p: p.memory_bytes)
    if len(front) > 1:
        path = " ".join(f"{'M' if i == 0 else 'L'}{_n(to_x(p.memory_bytes / GiB))},{_n(to_y(p.step_time_s))}"
                        for i, p in enumerate(front))
        body.append(f'<path d="{path}" fill="none" stroke="#2f5d8a" stroke-width="2" stroke-opacity="0.6">'
                    f"{_title('Pareto front: no other feasible plan is both faster and smaller')}</path>")
    for point in sorted(chart.points, key=lambda p: (p.chosen, p.on_front)):  # chosen drawn last, on top
        cx, cy = to_x(point.memory_bytes / GiB), to_y(point.step_time_s)
        status = "chosen" if point.chosen else ("Pareto front" if point.on_front else
                                                 ("feasible" if point.feasible else "does not fit"))
        past_right, past_top = view.beyond(point)
        where = ", beyond the chart" if past_right or past_top else ""
        tooltip = (f"{point.label}: {format_seconds(point.step_time_s)}, {format_bytes(point.memory_bytes)} "
                   f"per GPU ({status}{where})")
        if past_right or past_top:
            body.append(f'<polygon class="off-chart" points="{_arrow(cx, cy, past_right, past_top)}" '
                        f"{_point_style(point)}>{_title(tooltip)}</polygon>")
            continue
        radius = 9 if point.chosen else (6 if point.on_front else 5)
        body.append(f'<circle cx="{_n(cx)}" cy="{_n(cy)}" r="{radius}" {_point_style(point)}>'
                    f"{_title(tooltip)}</circle>")
        if point.chosen:
            anchor, label_x = ("start", cx + 13) if cx + 13 + _text_width("chosen", 12) <= right else ("end", cx - 13)
            body.append(_text(label_x, cy - 8, "chosen", anchor, 12, weight="600", halo=True))
    legend_y, legend_x = bottom + 62, left
    legend_marks = [(f'r="7" fill="#2f5d8a" stroke="{INK}" stroke-width="2"', "chosen plan"),
                    ('r="6" fill="#4e79a7"', "Pareto front (feasible)"),
                    ('r="5" fill="#9aa5b1"', "other feasible"),
                    (f'r="5" fill="#ffffff" stroke="{ALERT}" stroke-width="1.5"', "does not fit in memory")]
    for style, label in legend_marks:
        circle = f'<circle cx="{_n(legend_x + 6)}" cy="{_n(legend_y - 4)}" {style}>'
        body.append(f"{circle}{_title(label)}</circle>")
        body.append(_text(legend_x + 18, legend_y, label))
        legend_x += 40 + len(label) * 6.6
    height = legend_y + 14
    if view.off_chart:
        count = len(view.off_chart)
        label = f"beyond the chart ({count})"
        body.append(f'<polygon points="{_arrow(legend_x + 6, legend_y - 4, True, False)}" fill="#ffffff" '
                    f'stroke="{MUTED}" stroke-width="1.5">{_title(label)}</polygon>')
        body.append(_text(legend_x + 18, legend_y, label))
        most_memory = max(p.memory_bytes for p in view.off_chart)
        most_time = max(p.step_time_s for p in view.off_chart)
        note = (f"{count} candidate{'s' if count != 1 else ''} off the chart (up to {format_bytes(most_memory)} "
                f"per GPU, {format_seconds(most_time)} per step) drawn as triangles on its edge, pointing "
                f"where they lie; plan.json lists them all.")
        body.append(_text(left, legend_y + 22, note, size=11, fill=MUTED))
        height += 22
    return _svg("chart-pareto", height, "Candidates: step time against memory per GPU", body)


def _text_width(text: str, size: int) -> float:
    """A generous estimate of a label's width in px (sans-serif averages ~0.55 em per character)."""
    return len(text) * size * 0.6


SERVING_BOX = (88, WIDTH - 30, 20, 340)  # left, right, top, bottom of the plot area


def serving_svg(curve: ContinuousBatchingPrediction, replicas: int) -> Markup:
    """Throughput against latency under continuous batching: tokens/s over all replicas against the time per output
    token, one point per concurrency (requests in flight per replica), joined in order of concurrency."""
    left, right, top, bottom = SERVING_BOX
    points = curve.points
    if not points:
        body = [_text(left, top + 20, "Not one request of this length fits in the KV cache: no curve.", fill=ALERT)]
        return _svg("chart-serving", top + 40, "Throughput against time per output token", body, namespace=False)
    fastest, slowest = min(p.tpot_s for p in points), max(p.tpot_s for p in points)
    time_scale, time_unit = (1.0, "s") if slowest >= 1 else (1e3, "ms") if slowest >= 1e-3 else (1e6, "us")
    x_ticks = nice_ticks(fastest * time_scale * 0.95, slowest * time_scale * 1.05, 8)
    y_ticks = nice_ticks(0.0, max(p.tokens_per_s for p in points) * 1.08, 6)

    def to_x(seconds: float) -> float:
        return left + (seconds * time_scale - x_ticks[0]) / (x_ticks[-1] - x_ticks[0]) * (right - left)

    def to_y(tokens_per_s: float) -> float:
        return bottom - tokens_per_s / y_ticks[-1] * (bottom - top)

    body = []
    for tick in x_ticks:
        body.append(_line(to_x(tick / time_scale), top, to_x(tick / time_scale), bottom, GRID))
        body.append(_text(to_x(tick / time_scale), bottom + 18, _tick_label(tick), "middle", 11, MUTED))
    for tick in y_ticks:
        body.append(_line(left, to_y(tick), right, to_y(tick), GRID))
        body.append(_text(left - 8, to_y(tick) + 4, f"{tick:,.0f}" if tick >= 10 else f"{tick:g}", "end", 11,
                          MUTED))
    body.append(_text((left + right) / 2, bottom + 38, f"time per output token ({time_unit})", "middle", 12, MUTED))
    middle = _n((top + bottom) / 2)
    body.append(f'<text x="18" y="{middle}" text-anchor="middle" font-size="12" fill="{MUTED}" '
                f'transform="rotate(-90 18 {middle})">output tokens/s, {replicas} replica'
                f'{"s" if replicas != 1 else ""}</text>')
    if len(points) > 1:
        path = " ".join(f"{'M' if i == 0 else 'L'}{_n(to_x(p.tpot_s))},{_n(to_y(p.tokens_per_s))}"
                        for i, p in enumerate(points))
        body.append(f'<path d="{path}" fill="none" stroke="#2f5d8a" stroke-width="2" stroke-opacity="0.6">'
                    f"{_title('by concurrency: more requests in flight, more tokens/s, longer steps')}</path>")
    labels: list[tuple[float, float, float]] = []  # (x, y, half width) of the labels drawn
    for point in reversed(points):  # the largest concurrency first: its label is always drawn
        cx, cy = to_x(point.tpot_s), to_y(point.tokens_per_s)
        tooltip = (f"{point.concurrency:,} in flight per replica: {point.tokens_per_s:,.1f} tokens/s, "
                   f"{format_seconds(point.tpot_s)} per output token, {format_seconds(point.ttft_s)} to the first "
                   f"token")
        body.append(f'<circle cx="{_n(cx)}" cy="{_n(cy)}" r="5" fill="#4e79a7" stroke="#ffffff" '
                    f'stroke-width="1">{_title(tooltip)}</circle>')
        label = f"{point.concurrency:,}"
        half = _text_width(label, 11) / 2 + 2
        if all(abs(cx - x) > half + other or abs(cy - y) > 14 for x, y, other in labels):
            body.append(_text(cx, cy - 9, label, "middle", 11, INK, halo=True))
            labels.append((cx, cy, half))
    note = (f"Labels: requests in flight per replica (at most {curve.max_concurrency:,}, what the KV blocks hold); "
            f"each step carries at most {curve.step_tokens:,} tokens.")
    body.append(_text(left, bottom + 62, note, size=11, fill=MUTED))
    return _svg("chart-serving", bottom + 72, "Throughput against time per output token", body, namespace=False)
