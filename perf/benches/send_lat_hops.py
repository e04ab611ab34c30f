#!/usr/bin/env python3
"""Summarises the function_graph traces of perf/benches/send_lat_hops.sh.

--hops: per process, the median rxe_post_send; between the two processes, the median gap from
one's post end to the other's next post start (negative: the other posted while this post was
still in the kernel, having found its completion already).
--graph: per rxe_post_send, calls and microseconds of every traced function below it."""
import collections
import re
import statistics
import sys


def lines(path):
    for line in open(path, errors="replace"):
        parts = line.split("|")
        if len(parts) >= 4:
            yield parts


def hops(path):
    ev = []
    for p in lines(path):
        fn = p[3].strip()
        m = re.search(r"([\d.]+) us", p[2])
        if m and fn.startswith("rxe_post_send"):
            ev.append((float(p[0]), float(m.group(1)), p[1].split(")")[1].strip()))
    ev.sort()
    order = list(dict.fromkeys(e[2] for e in ev))
    print(f"== {path}: {len(ev)} posts")
    for pid in order:
        d = [x for _, x, q in ev if q == pid]
        print(f"  {pid}: post median {statistics.median(d):.2f} us over {len(d)}")
    gaps = collections.defaultdict(list)
    for (t0, d0, p0), (t1, _, p1) in zip(ev, ev[1:]):
        if p0 != p1:
            gaps[f"{p0} end -> {p1} start"].append((t1 - t0) * 1e6 - d0)
    for k, v in gaps.items():
        print(f"  gap {k}: median {statistics.median(v):.2f} us ({len(v)})")


def graph(path):
    tot, cnt, top = collections.Counter(), collections.Counter(), []
    for p in lines(path):
        fn = re.sub(r" \[\w+\]", "", p[3].strip())
        m = re.search(r"([\d.]+) us", p[2])
        name = re.match(r"\} /\* (\S+) \*/|(\S+)\(\);", fn)
        if not (m and name):
            continue
        name, d = name.group(1) or name.group(2), float(m.group(1))
        tot[name] += d
        cnt[name] += 1
        if name == "rxe_post_send":
            top.append(d)
    n = max(cnt["rxe_post_send"], 1)
    med = statistics.median(top) if top else 0.0
    print(f"== {path}: {len(top)} rxe_post_send, median {med:.1f} us")
    for name, t in sorted(tot.items(), key=lambda x: -x[1])[:25]:
        print(f"  {name:32s} calls/post {cnt[name] / n:6.2f}  us/call {t / cnt[name]:7.2f}")


if __name__ == "__main__":
    f = graph if sys.argv[1] == "--graph" else hops
    for path in sys.argv[2:]:
        f(path)
