#!/usr/bin/env python3
"""Attributes the icount plugin's user-space block counts of one interval to functions.

usage: attribute.py COUNTS MARK VCPU BINARY MAPS [TOP [FUNCTION]]   (kernel blocks: MAPS dir/kallsyms)
COUNTS is the plugin's output, MARK the number of the marker that ends the interval, VCPU the
vCPU to read, BINARY the executable and MAPS a copy of its /proc/PID/maps from that run (to place
its text and its libraries). Prints the instructions per function, largest first; with
FUNCTION (a substring of a function's name), the blocks inside it with their source lines
(`addr2line -i`: the inlined calls too).
"""
import bisect
import os
import re
import collections
import subprocess
import sys

counts, mark, vcpu, binary, maps = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
top = int(sys.argv[6]) if len(sys.argv) > 6 else 40
focus = sys.argv[7] if len(sys.argv) > 7 else None

blocks, cur = [], None
for line in open(counts):
    f = line.split()
    if f[0] == "mark":
        cur = int(f[1])
    elif f[0] == "tb" and cur == mark and f[1] == vcpu:
        blocks.append((int(f[2], 16), int(f[3])))

# Executable mappings: (start, end, file offset, path).
segs = []
for line in open(maps):
    f = line.split()
    if len(f) >= 6 and "x" in f[1]:
        a, b = (int(x, 16) for x in f[0].split("-"))
        segs.append((a, b, int(f[2], 16), f[5]))

symtabs = {}


def symbols(path):
    """Sorted (file offset, name) of a file's functions."""
    if path in symtabs:
        return symtabs[path]
    load = subprocess.run(["readelf", "-lW", path], capture_output=True, text=True).stdout
    shifts = []
    for l in load.splitlines():
        f = l.split()
        if f and f[0] == "LOAD" and "E" in f[6:]:
            shifts.append((int(f[1], 16), int(f[2], 16)))
    # A library's separate debug file (Debian's -dbg packages) names its internal functions.
    bid = subprocess.run(["readelf", "-nW", path], capture_output=True, text=True).stdout
    m = re.search(r"Build ID: ([0-9a-f]+)", bid)
    debug = m and f"/usr/lib/debug/.build-id/{m.group(1)[:2]}/{m.group(1)[2:]}.debug"
    out = subprocess.run(["nm", "-C", "--defined-only", "-n", debug if debug and os.path.exists(debug) else path], capture_output=True, text=True).stdout
    if not out.strip():
        out = subprocess.run(["nm", "-D", "-C", "--defined-only", "-n", path], capture_output=True, text=True).stdout
    syms = []
    for l in out.splitlines():
        f = l.split(" ", 2)
        if len(f) == 3 and f[1] in "tTwWiI":
            vaddr = int(f[0], 16)
            off = next((vaddr - v + o for o, v in shifts), vaddr)
            syms.append((off, f[2]))
    syms.sort()
    symtabs[path] = syms
    return syms


# The guest kernel's symbols (run.sh keeps them next to the maps).
kallsyms = []
try:
    for line in open(maps.rsplit("/", 1)[0] + "/kallsyms"):
        f = line.split()
        if len(f) >= 3 and f[1] in "tTwW":
            kallsyms.append((int(f[0], 16), f[2]))
except OSError:
    pass
kallsyms.sort()

per = collections.Counter()
inside = []
total = 0
for vaddr, n in blocks:
    total += n
    if vaddr >= 0xFFFF800000000000:
        i = bisect.bisect_right(kallsyms, (vaddr, "\uffff")) - 1
        per[f"[kernel]: {kallsyms[i][1] if i >= 0 else '?'}"] += n
        continue
    seg = next((s for s in segs if s[0] <= vaddr < s[1]), None)
    if seg is None:
        per["?"] += n
        continue
    off = vaddr - seg[0] + seg[2]
    syms = symbols(seg[3])
    i = bisect.bisect_right(syms, (off, "\uffff")) - 1
    name = syms[i][1] if i >= 0 else "?"
    lib = seg[3].rsplit("/", 1)[-1]
    per[f"{lib}: {name[:150]}"] += n
    if focus and focus in name:
        inside.append((n, off, seg[3]))

print(f"{total} instructions in blocks over the plugin's threshold (user and kernel)")
for name, n in per.most_common(top):
    print(f"{n:>12} {100 * n / total:5.1f}%  {name}")

if focus:
    inside.sort(reverse=True)
    for n, off, path in inside[:top]:
        load = subprocess.run(["readelf", "-lW", path], capture_output=True, text=True).stdout
        shift = next((int(f[2], 16) - int(f[1], 16) for f in (l.split() for l in load.splitlines())
                      if f and f[0] == "LOAD" and "E" in f[6:]), 0)
        lines = subprocess.run(["addr2line", "-i", "-C", "-f", "-e", path, hex(off + shift)],
                               capture_output=True, text=True).stdout.split("\n")
        where = " <- ".join(f"{lines[i + 1].rsplit('/', 1)[-1]}" for i in range(0, len(lines) - 1, 2))
        print(f"{n:>10} {100 * n / total:5.1f}%  {hex(off + shift)}  {where[:300]}")
