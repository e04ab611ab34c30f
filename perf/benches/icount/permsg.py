#!/usr/bin/env python3
"""Per-message guest instructions of each tool from an icount run (run.sh): the difference
between its N2 and N1 runs on vCPU 0 (the client) and vCPU 1 (the server), divided by N2 - N1.

usage: permsg.py COUNTS MARKS
"""
import collections
import sys

counts, marks = sys.argv[1], sys.argv[2]
at = {}
cur = None
for line in open(counts):
    f = line.split()
    if f[0] == "mark":
        cur = int(f[1])
    elif f[0] == "vcpu" and cur is not None:
        at[(cur, int(f[1]))] = (int(f[3]), int(f[5]))
runs = collections.defaultdict(list)
for line in open(marks):
    tool, n, m = line.split()
    runs[tool].append((int(n), int(m)))
for tool, rs in runs.items():
    (n1, m1), (n2, m2) = sorted(rs)[:2]
    for vcpu, who in ((0, "client"), (1, "server")):
        u1, k1 = at.get((m1, vcpu), (0, 0))
        u2, k2 = at.get((m2, vcpu), (0, 0))
        d = n2 - n1
        print(f"{tool:>9} {who}: user {(u2 - u1) / d:8.0f}  kernel {(k2 - k1) / d:8.0f}  instructions per message (mark {m2} - mark {m1})")
