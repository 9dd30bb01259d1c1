"""``runner audit report --html FILE``: the report as one page a person can look at.

Self-contained: inline SVG and CSS, no script, no font, no image and no link to fetch, and a
Content-Security-Policy that forbids loading anything, so the page shows the same with
networking and scripts off. Every value comes from the same ``AuditReport`` that ``--json``
prints (the bars carry their numbers as ``data-`` attributes and as text), and every string
from the log is HTML-escaped: a tool name is the caller's words.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from runner.audit.report import AuditReport, GroupStats
from runner.audit.timeline import OUTCOMES

COLOURS = {"success": "#2e7d32", "denied": "#ef6c00", "error": "#c62828", "cancelled": "#757575"}
P50, P95 = "#1565c0", "#90caf9"
MAX_BARS = 120  # time bars drawn; buckets are summed into this many at most
MAX_ROWS = 30  # bars of a ranked chart; the rest are summed into one "(others)" row
WIDTH, BAR_H, LABEL_W = 760, 18, 260
CSP = "default-src 'none'; style-src 'unsafe-inline'"  # nothing may be fetched, nothing may run

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:820px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}
table{border-collapse:collapse}td,th{padding:3px 10px;text-align:right;border-bottom:1px solid #ddd}
td:first-child,th:first-child{text-align:left}.note{color:#666}svg text{font-size:12px}
.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
"""


def render(report: AuditReport, source: str) -> str:
    """The whole page for ``report`` (grouped by tool), read from the log ``source``."""
    total = report.total
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        "<title>runner audit report</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>runner audit report</h1>",
        f'<p class="note">{_e(source)}, {_e(_since(report))}; made {_e(_now())}</p>',
        _totals(total),
        "<h2>Calls over time, by outcome</h2>",
        _legend(),
        _timeline(report),
        "<h2>Duration per tool (p50 and p95, ms)</h2>",
        _durations(report),
        "<h2>Denials by reason</h2>",
        _ranked("denials", list(total.denials.items()), "#ef6c00"),
        "<h2>Errors by code and reason</h2>",
        _ranked("errors", _errors(total), "#c62828"),
        "<h2>Circuit breaker openings</h2>",
        _ranked("breakers", list(report.breaker_openings.items()), "#6a1b9a"),
        "<h2>Per tool</h2>",
        _table(report),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _since(report: AuditReport) -> str:
    return f"events since {report.since.isoformat()}" if report.since else "every event"


def _totals(total: GroupStats) -> str:
    errors = sum(sum(reasons.values()) for reasons in total.errors.values())
    cells = [
        ("calls", total.calls),
        ("successes", total.successes),
        ("errors", errors),
        ("denials", sum(total.denials.values())),
        ("cancelled", total.cancelled),
    ]
    row = "".join(f'<td data-total="{name}">{count}</td>' for name, count in cells)
    head = "".join(f"<th>{name}</th>" for name, _ in cells)
    return f"<table><tr>{head}</tr><tr>{row}</tr></table>"


def _legend() -> str:
    items = "".join(f'<span><i style="background:{COLOURS[o]}"></i>{o}</span>' for o in OUTCOMES)
    return f'<p class="legend">{items}</p>'


def _timeline(report: AuditReport) -> str:
    timeline = report.timeline
    if not timeline.buckets:
        return '<p class="note">no calls</p>'
    first, last = min(timeline.buckets), max(timeline.buckets)
    slots = (last - first) // timeline.width_s + 1
    per_bar = -(-slots // MAX_BARS)  # buckets summed into one bar
    bars: list[dict[str, int]] = []
    for index in range(-(-slots // per_bar)):
        counts = dict.fromkeys(OUTCOMES, 0)
        for slot in range(index * per_bar, min((index + 1) * per_bar, slots)):
            for outcome, count in timeline.buckets.get(first + slot * timeline.width_s, {}).items():
                counts[outcome] += count
        bars.append(counts)
    height, top = 160, max(sum(bar.values()) for bar in bars) or 1
    step = (WIDTH - 40) / len(bars)
    seconds = timeline.width_s * per_bar
    shapes = []
    for index, bar in enumerate(bars):
        start = datetime.fromtimestamp(first + index * seconds, UTC)
        y = float(height)
        for outcome in OUTCOMES:
            count = bar[outcome]
            if not count:
                continue
            h = count / top * (height - 10)
            y -= h
            tip = f"{start:%Y-%m-%d %H:%M} +{timedelta(seconds=seconds)}: {count} {outcome}"
            shapes.append(
                f'<rect x="{40 + index * step:.1f}" y="{y:.1f}" width="{max(step - 1, 1):.1f}" '
                f'height="{h:.1f}" fill="{COLOURS[outcome]}" data-outcome="{outcome}" data-count="{count}">'
                f"<title>{_e(tip)}</title></rect>"
            )
    begin, end = datetime.fromtimestamp(first, UTC), datetime.fromtimestamp(last + timeline.width_s, UTC)
    axis = (
        f'<text x="0" y="12">{top}</text><text x="0" y="{height}">0</text>'
        f'<text x="40" y="{height + 16}">{begin:%Y-%m-%d %H:%M}</text>'
        f'<text x="{WIDTH}" y="{height + 16}" text-anchor="end">{end:%Y-%m-%d %H:%M} UTC</text>'
    )
    return _svg(height + 22, "".join(shapes) + axis, "calls over time")


def _durations(report: AuditReport) -> str:
    rows = []
    for name, stats in report.sorted_groups()[:MAX_ROWS]:
        p50, p95 = stats.durations.percentile(0.5), stats.durations.percentile(0.95)
        if p50 is not None and p95 is not None:
            rows.append((name, p50, p95))
    if not rows:
        return '<p class="note">no durations</p>'
    top = max(p95 for _, _, p95 in rows) or 1
    scale = (WIDTH - LABEL_W - 80) / top
    shapes = []
    for index, (name, p50, p95) in enumerate(rows):
        y = index * (2 * BAR_H + 6)
        shapes.append(f'<text x="0" y="{y + BAR_H + 4}">{_e(_short(name))}</text>')
        for offset, (label, value, colour) in enumerate((("p50", p50, P50), ("p95", p95, P95))):
            bar_y = y + offset * BAR_H
            shapes.append(
                f'<rect x="{LABEL_W}" y="{bar_y}" width="{max(value * scale, 1):.1f}" height="{BAR_H - 2}" '
                f'fill="{colour}" data-tool="{_e(name)}" data-{label}="{value:g}"></rect>'
                f'<text x="{LABEL_W + value * scale + 4:.1f}" y="{bar_y + 13}">{label} {value:g}</text>'
            )
    return _svg(len(rows) * (2 * BAR_H + 6), "".join(shapes), "duration per tool")


def _errors(total: GroupStats) -> list[tuple[str, int]]:
    return [
        (f"{code} {reason}", count)
        for code, reasons in total.errors.items()
        for reason, count in reasons.items()
    ]


def _ranked(kind: str, items: Sequence[tuple[str, int]], colour: str) -> str:
    """One horizontal bar per item, largest first; the tail summed as ``(others)``."""
    if not items:
        return f'<p class="note" data-chart="{kind}">none</p>'
    ordered = sorted(items, key=lambda item: (-item[1], item[0]))
    if len(ordered) > MAX_ROWS:
        ordered = [*ordered[: MAX_ROWS - 1], ("(others)", sum(count for _, count in ordered[MAX_ROWS - 1 :]))]
    top = ordered[0][1] or 1
    scale = (WIDTH - LABEL_W - 60) / top
    shapes = []
    for index, (label, count) in enumerate(ordered):
        y = index * (BAR_H + 4)
        shapes.append(
            f'<text x="0" y="{y + 13}">{_e(_short(label))}</text>'
            f'<rect x="{LABEL_W}" y="{y}" width="{max(count * scale, 1):.1f}" height="{BAR_H}" '
            f'fill="{colour}" data-chart="{kind}" data-label="{_e(label)}" data-count="{count}"></rect>'
            f'<text x="{LABEL_W + count * scale + 4:.1f}" y="{y + 13}">{count}</text>'
        )
    return _svg(len(ordered) * (BAR_H + 4), "".join(shapes), kind)


def _table(report: AuditReport) -> str:
    names = ("tool", "calls", "ok", "denied", "errors", "p50 ms", "p95 ms")
    head = "<tr>" + "".join(f"<th>{name}</th>" for name in names) + "</tr>"
    rows = []
    for name, stats in report.sorted_groups():
        errors = sum(sum(reasons.values()) for reasons in stats.errors.values())
        p50, p95 = stats.durations.percentile(0.5), stats.durations.percentile(0.95)
        cells = [stats.calls, stats.successes, sum(stats.denials.values()), errors, _ms(p50), _ms(p95)]
        rows.append(
            f'<tr data-group="{_e(name)}"><td>{_e(name)}</td>'
            + "".join(f"<td>{c}</td>" for c in cells)
            + "</tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _short(text: str, room: int = 36) -> str:
    return text if len(text) <= room else text[: room - 1] + "…"


def _svg(height: int, body: str, label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{_e(label)}" '
        f'width="{WIDTH + 20}" height="{max(height, BAR_H) + 4}">{body}</svg>'
    )
