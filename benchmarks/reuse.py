"""Reuse at scale: an unchanged table run again with --reuse, against its first run (#40).

    python benchmarks/reuse.py                                # 1M and 10M rows (long: the
                                                              # 10M first run is ~25 min here)
    python benchmarks/reuse.py --rows 100000 1000000 --out results/reuse-small.json

For each --rows: the product table of benchmarks/scale.py (benchmarks/products.py), one
``overnight run`` with the stand-in engine (benchmarks/standin: it answers at once, so only the
pipeline is measured, and counts the requests it gets), then the same command with --reuse over
the same table: every row's request is found in the first output and carried over. Reported for
both: rows/s over the whole command, the driver's peak RSS (``VmHWM`` at exit), the process tree's
peak RSS and PSS, and the requests that reached the engine; the re-run's output is checked to
hold the input's ids in input order.

Criteria (issue #40): at the largest table the re-run's rows/s is at least 10x the first run's,
and the re-run's driver peak RSS grows by less than 200 MiB from the smallest table to the
largest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.products import make_products  # noqa: E402
from benchmarks.scale import _requests, job, run_job_measured, scratch_with_model  # noqa: E402
from benchmarks.throughput import REPO, commit  # noqa: E402


def measured(args, config: dict, work: Path, name: str, files: list[Path]) -> dict:
    log = work / f"{name}.requests"
    log.unlink(missing_ok=True)
    result = run_job_measured(args, config, work, name, files, "parquet", requests_log=log)
    result["engine_requests"] = _requests(log) if log.exists() else 0
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--scratch", default="/tmp/overnight-reuse")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--row-group", type=int, default=1_000_000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--note", default="", help="kept with the results: which code, which machine")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "reuse.json"))
    args = ap.parse_args()
    args.rows = sorted(args.rows)

    work, tiny = scratch_with_model(args.scratch)
    results = {}
    for rows in args.rows:
        print(f"table of {rows} rows ...", file=sys.stderr)
        files = make_products(work / f"products-{rows}", rows, args.files, args.row_group)
        config = job(str(tiny), work / f"products-{rows}", work / f"out-{rows}",
                     args.max_tokens, None)
        print(f"first run, {rows} rows ...", file=sys.stderr)
        first = measured(args, config, work, f"out-{rows}", files)
        print(f"--reuse, {rows} rows ...", file=sys.stderr)
        config["output"]["reuse"] = True
        again = measured(args, config, work, f"out-{rows}", files)
        report = json.loads(Path(str(work / f"out-{rows}") + ".report.json").read_text())
        results[str(rows)] = {"first": first, "reuse": again, "reuse_report": report.get("reuse"),
                              "speedup": again["rows_per_s"] / first["rows_per_s"]}
        print(f"{rows}: first {first['rows_per_s']:,.0f} rows/s, reuse "
              f"{again['rows_per_s']:,.0f} rows/s ({results[str(rows)]['speedup']:.1f}x); "
              f"driver peak {first['driver_peak_rss_mib']:.0f} / "
              f"{again['driver_peak_rss_mib']:.0f} MiB", file=sys.stderr)
    small, large = results[str(args.rows[0])], results[str(args.rows[-1])]
    growth = large["reuse"]["driver_peak_rss_mib"] - small["reuse"]["driver_peak_rss_mib"]
    out = {"measured": time.strftime("%Y-%m-%d"), "commit": commit(), "note": args.note,
           "rows": args.rows, "results": results,
           "reuse_driver_rss_growth_mib": growth,
           "criteria": {"speedup_at_largest_10x": large["speedup"] >= 10,
                        "driver_rss_growth_under_200_mib": growth < 200,
                        "nothing_reached_the_engine_again": all(
                            r["reuse"]["engine_requests"] == 0 for r in results.values()),
                        "ids_in_input_order": all(r["reuse"]["ids_in_input_order"]
                                                  for r in results.values())}}
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["criteria"]), file=sys.stderr)


if __name__ == "__main__":
    main()
