"""perftest and two rixl-perf builds in alternating rounds in one rxe guest boot (bandwidth rows).

Run inside the guest:
  scripts/rxe-guest run -- python3 perf/benches/ab_three_way.py --old OLD --new NEW [--rounds 8]
Prints every round, the medians, each build's ratio to perftest and the paired new/old ratios.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_perftest import measure  # noqa: E402

TESTS = [("write_bw", 64, 20000), ("read_bw", 4096, 5000), ("send_bw", 4096, 5000)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="rixl-perf before the change")
    ap.add_argument("--new", required=True, help="rixl-perf with the change")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    bins = {"old": a.old, "new": a.new}
    order = ["perftest", "old", "new"]
    res = {}
    for r in range(a.rounds):
        for t, size, n in TESTS:
            for name in order if r % 2 == 0 else order[::-1]:
                tool = "perftest" if name == "perftest" else "rixl"
                try:
                    m = measure(tool, t, size, n, 1, bins.get(name))
                except RuntimeError as e:
                    print("ERR", r, t, name, str(e)[-200:], flush=True)
                    continue
                res.setdefault((t, name), []).append(m["bw_avg"])
                print(r, t, size, name, m["bw_avg"], flush=True)
    for t, size, _ in TESTS:
        pt = statistics.median(res.get((t, "perftest"), [float("nan")]))
        for name in order:
            v = res.get((t, name), [])
            if v:
                med = statistics.median(v)
                print(f"{t} {size} {name}: median {med:.3f}  ratio-to-perftest {med / pt:.3f}  {v}")
        old, new = res.get((t, "old"), []), res.get((t, "new"), [])
        pairs = [y / x for x, y in zip(old, new)]
        if pairs:
            print(f"{t} new/old per round: {[round(p, 2) for p in pairs]} median {statistics.median(pairs):.3f}")


if __name__ == "__main__":
    main()
