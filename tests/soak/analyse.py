"""Per-phase RSS figures from a soak CSV: python3 analyse.py soak_default.csv [...]

For each phase (consecutive rows with the same cycle): RSS at its start and end, items settled
in it, KB per settled item, KB per minute, and a least-squares slope of RSS vs settled items.
"""

from __future__ import annotations

import csv
import sys


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def main(path: str) -> None:
    with open(path) as file:
        rows = list(csv.DictReader(file))
    print(f"== {path}: {len(rows)} samples; RSS first={rows[0]['rss_kb']} KB"
          f" (t={rows[0]['t_s']}), after warm-up (t={rows[1]['t_s']})={rows[1]['rss_kb']} KB,"
          f" last={rows[-1]['rss_kb']} KB (t={rows[-1]['t_s']})")
    cycles: dict[str, list[dict[str, str]]] = {}
    for r in rows[1:]:  # the t=0 sample is the interpreter starting: phase 0 starts warm

        cycles.setdefault(r["cycle"], []).append(r)
    keys = sorted(cycles, key=int)
    print(f"{'cyc':>3} {'phase':9} {'t0':>6} {'t1':>6} {'rss0':>7} {'rss1':>7} {'dRSS':>6}"
          f" {'items':>6} {'KB/item':>8} {'fit':>7} {'KB/min':>7} {'anon1':>7} {'fds':>4}")
    for i, k in enumerate(keys):
        seg = cycles[k]
        # the phase's end is the next phase's first sample (the boundary)
        end = cycles[keys[i + 1]][0] if i + 1 < len(keys) else seg[-1]
        pts = seg + ([end] if end is not seg[-1] else [])
        start = seg[0]
        d_rss = int(end["rss_kb"]) - int(start["rss_kb"])
        items = int(end["settled"]) - int(start["settled"])
        mins = (float(end["t_s"]) - float(start["t_s"])) / 60
        fit = slope([float(p["settled"]) for p in pts], [float(p["rss_kb"]) for p in pts])
        per_item = d_rss / items if items else float("nan")
        print(f"{k:>3} {seg[0]['phase']:9} {float(start['t_s']):6.0f} {float(end['t_s']):6.0f}"
              f" {start['rss_kb']:>7} {end['rss_kb']:>7} {d_rss:6d} {items:6d} {per_item:8.3f}"
              f" {fit:7.3f} {d_rss / mins if mins else 0:7.1f} {end['anon_kb']:>7}"
              f" {end['fds']:>4}")
    by: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        seg = cycles[k]
        end = cycles[keys[i + 1]][0] if i + 1 < len(keys) else seg[-1]
        agg = by.setdefault(seg[0]["phase"], [0, 0])
        agg[0] += int(end["rss_kb"]) - int(seg[0]["rss_kb"])
        agg[1] += int(end["settled"]) - int(seg[0]["settled"])
    for phase, (d, n) in by.items():
        print(f"  total {phase:9}: dRSS={d} KB over {n} items = "
              f"{(d / n if n else float('nan')):.3f} KB/item")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        main(p)
