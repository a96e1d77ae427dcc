"""The run report as one self-contained HTML page (``overnight report OUTPUT --html FILE``):
the text table, charts drawn as inline SVG bars, and tables of sample rows, errors and replicas."""

from __future__ import annotations

import html

from pipelines.report.report_text import replica_hardware, report_lines


def render_html(report: dict) -> str:
    """One self-contained page: the text table, an output-length histogram and throughput
    over time, drawn as inline SVG (no script, no network)."""
    hist = report["histogram"]["output_tokens"]
    bars = [(f"{lo}-{hi - 1}", n) for lo, hi, n in
            zip(hist["edges"], hist["edges"][1:], hist["counts"])]
    charts = [_svg_bars("Output length (tokens per row)", bars, "rows")]
    if report.get("steps"):  # the funnel: the rows each step passes on
        first = report["steps"][0]
        charts.insert(0, _svg_bars("Rows at each step (the funnel: input, then each step's "
                                   "rows out)", [("input", first["rows_in"])] + [
            (s["name"], s["rows_out"]) for s in report["steps"]], "rows"))
    samples = report.get("samples") or []
    timeline = report.get("timeline") or []
    if len(samples) > 1:
        charts.append(_svg_bars("Throughput over time (output tokens/s, sampled from the "
                                "replicas as they generate)", _sampled_rates(samples), "tok/s"))
    elif timeline:
        charts.append(_svg_bars("Throughput over time (output tokens/s, per part written)",
                                _rates(timeline, report["time"]["startup_s"]), "tok/s"))
    table = "\n".join(html.escape(line) for line in report_lines(report))
    tables = "".join([_html_table("Sample rows: input and output", report.get("sample_rows"),
                                  generated=report.get("output_column")),
                      _html_table("Errors by kind", [
                          {"kind": k, "rows": e["count"],
                           "example ids": ", ".join(map(str, e["examples"]))}
                          for k, e in report["rows"]["errors_by_kind"].items()]),
                      _html_table("Steps", report.get("steps")),
                      _html_table("Replicas", [
                          {"replica": n, "machine": r.get("node"), "ran on": replica_hardware(r),
                           "rows": r["rows"], "output tokens": f"{r['output_tokens']:,}",
                           "seconds": r.get("seconds"),
                           "tok/s": f"{r['output_tokens_per_s']:,.0f}"}
                          for n, r in enumerate((report.get("throughput") or {}).get(
                              "per_replica") or [], 1)])])
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>overnight report: {html.escape(report['output'])}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }}
/* the text report is a table in text: its lines kept whole (the block scrolls if it must) */
pre {{ background: #f6f6f4; padding: 1em; white-space: pre; overflow-x: auto;
  width: max-content; max-width: 100%; box-sizing: border-box; }}
svg {{ display: block; margin: 1.5em 0; }}
table {{ border-collapse: collapse; margin: 1em 0 2em; font-size: 13px; }}
th, td {{ border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top;
  word-break: normal; overflow-wrap: break-word; }}
/* ids, numbers, headers: one line, never broken inside; long text wraps between words */
th, td.short {{ white-space: nowrap; }}
td.text {{ min-width: 12em; max-width: 28em; }} td.generated {{ min-width: 24em; max-width: 48em; }}
th {{ background: #f0f0ec; }}
.bar {{ fill: #4a7ab7; }} .axis {{ stroke: #888; }} text {{ font-size: 11px; fill: #333; }}
</style></head><body>
<h1>overnight run report</h1>
<pre>{table}</pre>
{''.join(charts)}
{tables}
</body></html>
"""


SHORT = 32  # a column whose values are all this short (ids, numbers) keeps to one line
BOOKKEEPING = ("request_key", "error")  # a sample row's bookkeeping: last, and only if filled


def _html_table(title: str, rows: list[dict] | None, generated: str | None = None) -> str:
    """A table with the generated column given the room: the row's own columns, the
    generated text, then bookkeeping where any row has it."""
    if not rows:
        return ""
    cell = lambda v: "" if v is None else str(v)  # noqa: E731
    heads = list(dict.fromkeys(k for row in rows for k in row))
    kept = [h for h in heads if h in BOOKKEEPING and any(cell(r.get(h)) for r in rows)]
    heads = [h for h in heads if h not in BOOKKEEPING and h != generated] \
        + ([generated] if generated in heads else []) + kept
    kinds = {h: "generated" if h == generated else "short" if all(
        len(cell(r.get(h))) <= SHORT and "\n" not in cell(r.get(h)) for r in rows) else "text"
        for h in heads}
    body = "".join("<tr>" + "".join(f'<td class="{kinds[h]}">{html.escape(cell(row.get(h)))}'
                                    "</td>" for h in heads) + "</tr>" for row in rows)
    return (f"<h2>{html.escape(title)}</h2><table><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in heads) + f"</tr>{body}</table>")


def _sampled_rates(samples: list[dict], bins: int = 20) -> list[tuple[str, float]]:
    """Output tokens/s between the replicas' samples, in equal time slices."""
    start, end = samples[0]["t"], samples[-1]["t"]
    width = max((end - start) / bins, 1e-3)
    tokens = [0.0] * bins
    for before, after in zip(samples, samples[1:]):
        tokens[min(int((after["t"] - start) / width), bins - 1)] += \
            after["tokens"] - before["tokens"]
    digits = 0 if width >= 1 else 1
    return [(f"{start + i * width:.{digits}f}s", n / width) for i, n in enumerate(tokens)]


def _rates(timeline: list[dict], startup: float, bins: int = 20) -> list[tuple[str, float]]:
    """Output tokens/s in equal time slices from the first engine ready to the last part, each
    part's tokens counted in the slice where it finished."""
    end = timeline[-1]["t"]
    width = max((end - startup) / bins, 1e-3)
    tokens = [0] * bins
    for entry in timeline:
        tokens[min(int((entry["t"] - startup) / width), bins - 1)] += entry["output_tokens"]
    digits = 0 if width >= 1 else 1
    return [(f"{startup + i * width:.{digits}f}s", n / width) for i, n in enumerate(tokens)]


def _svg_bars(title: str, bars: list[tuple[str, float]], unit: str,
              width: int = 720, height: int = 220) -> str:
    if not bars:
        return ""
    top = max(v for _, v in bars) or 1
    left, bottom, plot_h = 50, 40, height - 70
    step = (width - left - 10) / len(bars)
    parts = [f'<svg width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(title)}">',
             f'<text x="{left}" y="16" style="font-size:13px">{html.escape(title)}</text>',
             f'<line class="axis" x1="{left}" y1="{height - bottom}" x2="{width - 10}" '
             f'y2="{height - bottom}"/>',
             f'<text x="4" y="34">{top:,.0f} {unit}</text>']
    label_every = max(1, len(bars) // 10)
    for i, (label, value) in enumerate(bars):
        h = plot_h * value / top
        x = left + i * step
        parts.append(f'<rect class="bar" x="{x + 1:.1f}" y="{height - bottom - h:.1f}" '
                     f'width="{max(step - 2, 1):.1f}" height="{h:.1f}">'
                     f'<title>{html.escape(label)}: {value:,.0f} {unit}</title></rect>')
        if i % label_every == 0:
            parts.append(f'<text x="{x + 1:.1f}" y="{height - bottom + 14}">'
                         f'{html.escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
