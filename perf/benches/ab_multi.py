"""perftest and any number of rixl-perf builds (or one build with different flags) in alternating
rounds in one rxe guest boot.

Run inside the guest:
  scripts/rxe-guest run -- python3 perf/benches/ab_multi.py \
      "old=target/rixl-perf-old,new=target/release/rixl-perf,new-nc=target/release/rixl-perf|--no-coalesce" \
      send_bw:4096:5000,send_lat:64:3000 6
Builds are NAME=PATH[|EXTRA ARGS]; rows are test:size:messages; the last argument is the number of
rounds (even rounds run perftest first, odd rounds last). Prints every round, then each build's
median, its ratio to perftest's median and the median of its paired per-round ratios.

Code layout alone moves the emulated latency rows by about 4 % (docs/perf.md): to judge a change,
include a build of the old code with an unrelated change as a control.
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_perftest import measure  # noqa: E402
bins = {k: v.split("|") for k, v in (x.split("=") for x in sys.argv[1].split(","))}
tests = [(t, int(s), int(n)) for t, s, n in (x.split(":") for x in sys.argv[2].split(","))]
rounds = int(sys.argv[3])
names = ["perftest"] + list(bins)
res = {}
for r in range(rounds):
    order = names if r % 2 == 0 else names[::-1]
    for t, size, n in tests:
        retries = {}
        for name in order:
            try:
                m = measure("perftest" if name == "perftest" else "rixl", t, size, n, 1, bins[name][0] if name in bins else None, bins[name][1].split() if name in bins and len(bins[name]) > 1 else ())
            except Exception as e:
                print("ERR", r, t, name, str(e)[-200:], flush=True); continue
            key = "t_typical" if t.endswith("_lat") else "bw_avg"
            res.setdefault((t, size, name), []).append(m[key])
            retries[name] = m.get("retries")
        print(r, t, size, {k: res.get((t, size, k), [None])[-1] for k in names}, "rxe retries", retries, flush=True)
for t, size, _ in tests:
    p = res[(t, size, "perftest")]
    for name in names:
        v = res.get((t, size, name), [])
        paired = [a / b for a, b in zip(v, p)]
        print(f"{t} {size} {name}: median {statistics.median(v):.2f} ratio {statistics.median(v)/statistics.median(p):.3f} paired {statistics.median(paired):.3f} {v}")
