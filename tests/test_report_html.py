"""The run report's page and text, rendered from a report (no engine): the generated text has
the room, bookkeeping comes last and only where filled, replicas are said in words."""

from __future__ import annotations

from pipelines.report.report_html import render_html
from pipelines.report.report_text import report_lines


def _report(per_replica: list[dict]) -> dict:
    """A finished run's report (run_report.build_report's shape), of 2 rows on 1 replica."""
    return {
        "output": "out/demo", "created": "2026-12-07T06:41:33+0000", "fingerprint": "9f6af766",
        "model": {"name": "models/smollm2"}, "sampling": {"max_tokens": 64},
        "rows": {"input": 2, "output": 2, "ok": 2, "skipped": 0, "dropped": 0, "errors": 0,
                 "resumed": 0, "errors_by_kind": {}},
        "files": {"count": 1, "largest_rows": 2},
        "tokens": {k: {"total": 20, "mean": 10.0, "p50": 10, "p95": 10, "max": 10}
                   for k in ("prompt", "output")},
        "histogram": {"output_tokens": {"edges": [0, 10, 20], "counts": [0, 2]}},
        "recovery": {"restarts": [], "retried_blocks": 0, "isolated_rows": 0,
                     "isolated_causes": []},
        "time": {"total_s": 49.2, "startup_s": 37.0, "preflight_s": 0.5, "ray_start_s": 8.3,
                 "engine_start_s": 28.2, "generation_s": 10.3, "finish_s": 2.0},
        "throughput": {"output_tokens": 20, "output_tokens_per_s": 2.0, "rows_per_s": 0.2,
                       "prompt_tokens_per_s": 2.0, "per_replica": per_replica},
        "sample_rows": [{"sku": f"SKU-0000{i}", "description": "A rugged steel bottle for "
                         "everyday use, café-style finish, made to last a lifetime of trips.",
                         "request_key": "8e47a9038bbce41220dcc4c63b6756ab", "error": None,
                         "rewritten": "Rugged steel bottle. A bold and unapologetic choice "
                         "for everyday use, built for the long road."} for i in (1, 2)],
        "output_column": "rewritten",
    }


CPU_REPLICA = {"node": "192.0.2.2", "node_id": "375d1af30570", "actor": "c14cf0ff96b8",
               "gpus": [], "cpu_threads": 2, "dtype": "float32", "rows": 2,
               "output_tokens": 20, "parts": 1, "seconds": 10.3, "output_tokens_per_s": 1.9}


def test_replicas_are_said_in_words_not_in_rays_ids():
    gpu = {**CPU_REPLICA, "gpus": ["0", "1"], "cpu_threads": None, "dtype": "bfloat16"}
    lines = report_lines(_report([CPU_REPLICA, gpu]))
    replicas = [line for line in lines if line.startswith("  replica ")]
    assert replicas == [
        "  replica 1 on 192.0.2.2 (no GPU: 2 CPU threads), float32: 2 rows, 20 tok, 2 tok/s",
        "  replica 2 on 192.0.2.2 (GPUs 0,1), bfloat16: 2 rows, 20 tok, 2 tok/s"]
    page = render_html(_report([CPU_REPLICA, gpu]))
    for ray_id in ("375d1af30570", "c14cf0ff96b8", "gpus []", "<th>gpus</th>"):
        assert ray_id not in page
    assert "<td class=\"short\">no GPU: 2 CPU threads</td>" in page


def test_the_sample_rows_give_the_generated_text_the_room_and_bookkeeping_comes_last():
    page = render_html(_report([CPU_REPLICA]))
    table = page.split("<h2>Sample rows: input and output</h2>")[1].split("</table>")[0]
    heads = [h.split("</th>")[0] for h in table.split("<th>")[1:]]
    assert heads == ["sku", "description", "rewritten", "request_key"]  # no empty error
    cells = table.split("</tr>")[1]
    assert '<td class="short">SKU-00001</td>' in cells  # an id keeps to one line
    assert '<td class="text">A rugged' in cells and '<td class="generated">Rugged' in cells
    assert "th, td.short { white-space: nowrap; }" in page
    assert "white-space: pre;" in page  # the text report's lines kept whole
