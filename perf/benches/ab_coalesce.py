#!/usr/bin/env python3
"""A/B of the engine's small-transfer coalescing, next to perftest, in ONE rxe guest boot:
write_bw at -l 1 (one descriptor per transfer future) and write_lat, alternating rounds, medians.
Run: scripts/rxe-guest run -- python3 benches/ab_coalesce.py --rixl target/release/rixl-perf"""
import argparse
import statistics
import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))
from compare_perftest import DEV, GID, parse_row, run_pair  # noqa: E402


def bw(tool, rixl, size, iters, extra):
    if tool == "perftest":
        base = ["timeout", "150", "ib_write_bw", "-d", DEV, "-x", GID, "-s", str(size), "-n", str(iters), "-F"]
    else:
        base = [rixl, "write_bw", "-d", DEV, "-x", GID, "-s", str(size), "-n", str(iters), "-F"] + extra
    row = parse_row(run_pair(base, base + ["127.0.0.1"]), size)
    return row[2], row[3]  # BW average MiB/s, MsgRate Mpps


def lat(tool, rixl, size, iters, extra):
    if tool == "perftest":
        base = ["timeout", "150", "ib_write_lat", "-d", DEV, "-x", GID, "-s", str(size), "-n", str(iters), "-F"]
    else:
        base = [rixl, "write_lat", "-d", DEV, "-x", GID, "-s", str(size), "-n", str(iters), "-F"] + extra
    row = parse_row(run_pair(base, base + ["127.0.0.1"]), size)
    return row[3]  # t_typical


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rixl", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    tools = [("perftest", []), ("rixl", ["--coalesce"]), ("rixl --no-coalesce", [])]
    res = {}
    for r in range(a.rounds):
        order = tools if r % 2 == 0 else list(reversed(tools))
        for size, iters in [(64, 20000), (4096, 20000), (65536, 5000)]:
            for name, extra in order:
                v = bw("perftest" if name == "perftest" else "rixl", a.rixl, size, iters, extra)
                res.setdefault(("write_bw", size, name), []).append(v)
        for size in [64, 4096]:
            for name, extra in order:
                v = lat("perftest" if name == "perftest" else "rixl", a.rixl, size, 2000, extra)
                res.setdefault(("write_lat", size, name), []).append(v)
        print(f"round {r + 1} done", file=sys.stderr, flush=True)
    print("| test | size | perftest | rixl (coalesce) | rixl --no-coalesce | coalesce/perftest | no-coalesce/perftest |")
    print("|---|---|---|---|---|---|---|")
    for (test, size) in [("write_bw", 64), ("write_bw", 4096), ("write_bw", 65536), ("write_lat", 64), ("write_lat", 4096)]:
        med = {}
        for name, _ in tools:
            vals = res[(test, size, name)]
            if test == "write_bw":
                key = 1 if size == 64 else 0  # Mpps at 64 B, MiB/s otherwise
                med[name] = statistics.median(v[key] for v in vals)
            else:
                med[name] = statistics.median(vals)
        unit = "Mpps" if (test == "write_bw" and size == 64) else ("MiB/s" if test == "write_bw" else "us")
        p, c, n = med["perftest"], med["rixl"], med["rixl --no-coalesce"]
        print(f"| {test} | {size} | {p:.3f} {unit} | {c:.3f} | {n:.3f} | {c / p:.2f} | {n / p:.2f} |")


if __name__ == "__main__":
    main()
