"""What ``runner audit verify`` and ``runner audit report`` print for a person."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.audit.key import ChainKey
    from runner.audit.report import AuditReport, GroupStats
    from runner.audit.verify import ChainVerdict
    from runner.cli.terminal import Cell, Output


def print_verdict(verdict: ChainVerdict, path: Path, key: ChainKey | None, out: Output) -> None:
    from runner.audit.query import escape_cell

    shown = escape_cell(str(path))
    counts = f"{verdict.lines} lines, {verdict.chained} chained"
    if verdict.unchained_prefix:
        counts += f" ({verdict.unchained_prefix} unchained before the first chained one, allowed)"
    if not verdict.lines and verdict.intact:
        out.write(f"{out.paint('empty', 'warn')}: {shown}: 0 lines")
        out.write("an emptied log cannot be told from a new one: compare with a head recorded elsewhere")
        return
    if verdict.intact:
        out.write(f"{out.paint('intact', 'ok')}: {shown}: {counts}")
        if key is not None:
            out.write(f"keyed: HMAC-SHA256 with the key from {escape_cell(key.where)}")
        else:
            out.write("unkeyed: SHA-256, which whoever can write the file can recompute (see audit.key)")
        if verdict.anchor_line is not None:
            out.write(f"anchor found at line {verdict.anchor_line}: nothing up to it was cut or rewritten")
        if verdict.head:
            out.write(f"head {verdict.head}  (record it elsewhere: removed last lines show only against it)")
        return
    first = verdict.problems[0]
    out.write(f"{out.paint('NOT intact', 'bad')}: {shown}: line {first.line}: {first.kind}: {first.detail}")
    out.write(f"{counts}; {verdict.problem_count} problem(s):")
    for problem in verdict.problems:
        out.write(f"  line {problem.line}: {out.paint(problem.kind, 'warn')}: {problem.detail}")
    if verdict.problem_count > len(verdict.problems):
        out.write(f"  ... and {verdict.problem_count - len(verdict.problems)} more")
    if verdict.none_matched:
        which = "this key" if key is not None else "unkeyed SHA-256"
        out.write(
            f"no line's hash matches its text with {which}: the wrong key, or a log written "
            "with a key checked without it (or the reverse), more likely than every line edited"
        )


def print_report(report: AuditReport, out: Output) -> None:
    from runner.cli.terminal import Cell, Column, Table

    columns = [
        Column(report.by.upper()),
        Column("CALLS"),
        Column("OK"),
        Column("DENIED"),
        Column("ERRORS"),
        Column("P50 MS"),
        Column("P95 MS"),
        Column("DENIALS AND ERRORS"),
    ]
    rows = [report_row(Cell(name, "key"), stats) for name, stats in report.sorted_groups()]
    rows.append(report_row(Cell("(all)", "head"), report.total))
    Table(out, columns).print(rows)
    if report.chained:
        out.write(
            out.paint(
                f"a chained log: only chained lines counted, {report.unchained_skipped} unchained "
                "skipped (runner audit verify checks the chain)",
                "dim",
            )
        )
    if report.since is not None:
        out.write(out.paint(f"since {report.since.isoformat()}", "dim"))


def report_row(name: Cell, stats: GroupStats) -> list[Cell | str]:
    from runner.cli.terminal import Cell

    denied = sum(stats.denials.values())
    errors = sum(sum(reasons.values()) for reasons in stats.errors.values())
    why = [f"denied {reason} {count}" for reason, count in stats.denials.most_common()]
    why += [
        f"{code} {reason} {count}"
        for code, reasons in sorted(stats.errors.items())
        for reason, count in reasons.most_common()
    ]
    p50, p95 = stats.durations.percentile(0.5), stats.durations.percentile(0.95)
    return [
        name,
        str(stats.calls),
        Cell(str(stats.successes), "ok") if stats.successes else "0",
        Cell(str(denied), "bad") if denied else "0",
        Cell(str(errors), "bad") if errors else "0",
        _ms(p50),
        _ms(p95),
        "; ".join(why) or "-",
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
