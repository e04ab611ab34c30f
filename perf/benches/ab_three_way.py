"""perftest and two rixl-perf builds in alternating rounds in one rxe guest boot.

Run inside the guest:
  scripts/rxe-guest run -- python3 perf/benches/ab_three_way.py --old OLD --new NEW [--rounds 8] [--lat]
    [--tests send_bw:4096:5000,send_lat:64:2000] [--old-args "--copy"] [--new-args "..."]
Bandwidth rows (MiB/s), or with --lat the 64 B latency rows (t_typical, us); --tests picks the
rows (test:size:messages). OLD and NEW may be one binary run with different --old-args and
--new-args. Prints every round, the medians, each build's ratio to perftest and the paired
new/old ratios.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_perftest import measure  # noqa: E402

BW_TESTS = [("write_bw", 64, 20000), ("read_bw", 4096, 5000), ("send_bw", 4096, 5000)]
LAT_TESTS = [("write_lat", 64, 2000), ("read_lat", 64, 2000), ("send_lat", 64, 2000)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="rixl-perf before the change")
    ap.add_argument("--new", required=True, help="rixl-perf with the change")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--lat", action="store_true", help="the latency rows instead of bandwidth")
    ap.add_argument("--tests", help="rows as test:size:messages,... (instead of the defaults)")
    ap.add_argument("--old-args", default="", help="extra rixl-perf arguments of OLD")
    ap.add_argument("--new-args", default="", help="extra rixl-perf arguments of NEW")
    a = ap.parse_args()
    tests = LAT_TESTS if a.lat else BW_TESTS
    if a.tests:
        tests = [(t, int(size), int(n)) for t, size, n in (x.split(":") for x in a.tests.split(","))]
    bins = {"old": a.old, "new": a.new}
    extra = {"old": a.old_args.split(), "new": a.new_args.split()}
    order = ["perftest", "old", "new"]
    res = {}
    for r in range(a.rounds):
        for t, size, n in tests:
            for name in order if r % 2 == 0 else order[::-1]:
                tool = "perftest" if name == "perftest" else "rixl"
                try:
                    m = measure(tool, t, size, n, 1, bins.get(name), extra.get(name, ()))
                except RuntimeError as e:
                    print("ERR", r, t, name, str(e)[-200:], flush=True)
                    continue
                key = "t_typical" if t.endswith("_lat") else "bw_avg"
                res.setdefault((t, size, name), []).append(m[key])
                print(r, t, size, name, m[key], flush=True)
    for t, size, _ in tests:
        pt = statistics.median(res.get((t, size, "perftest"), [float("nan")]))
        for name in order:
            v = res.get((t, size, name), [])
            if v:
                med = statistics.median(v)
                print(f"{t} {size} {name}: median {med:.3f}  ratio-to-perftest {med / pt:.3f}  {v}")
        old, new = res.get((t, size, "old"), []), res.get((t, size, "new"), [])
        pairs = [y / x for x, y in zip(old, new)]
        if pairs:
            print(f"{t} {size} new/old per round: {[round(p, 2) for p in pairs]} median {statistics.median(pairs):.3f}")


if __name__ == "__main__":
    main()
