#!/usr/bin/env python3
"""fio vs `rixl-perf file` on one file: same rw, bs, iodepth and size, alternating rounds,
medians and ratios (rixl / fio). Both run pinned to the same CPU. fio runs at its best: io_uring
with registered buffers and files (`fixedbufs`, `registerfiles`), as rixl's glommio core uses
registered buffers; without them fio pins pages per I/O and was 0.5-0.6x as fast at 1 MiB here."""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr}{p.stdout}")
    return p.stdout


def fio(path, rw, bs, depth, size, cpu):
    out = run(["fio", "--name=rixl-compare", f"--filename={path}", f"--size={size}",
               f"--bs={bs}", f"--iodepth={depth}", f"--rw={rw}", "--direct=1",
               "--ioengine=io_uring", f"--cpus_allowed={cpu}", "--randrepeat=1",
               "--norandommap=0", "--fixedbufs=1", "--registerfiles=1",
               "--output-format=json"])
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read"] if "read" in rw else job["write"]
    return side["bw_bytes"] / 2**20


def rixl(binary, path, rw, bs, depth, size, cpu, tmp):
    run([binary, "file", "--filename", path, "--rw", rw, "--bs", bs, "--iodepth", str(depth),
         "--size", size, "--cpu", str(cpu), "--out_json", tmp])
    with open(tmp) as f:
        return json.load(f)["bw_MiBps"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rixl", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--size", default="2g")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iodepth", type=int, default=32)
    ap.add_argument("--cpu", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="one round, 256m, two block sizes")
    ap.add_argument("--sizes", default="128k,256k,512k,1m", help="comma-separated block sizes")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    d = a.dir or os.path.join(os.path.dirname(a.out), "compare-fio-data")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "bench.bin")
    sizes = a.sizes.split(",")
    rws = ["write", "read", "randwrite", "randread"]
    if a.quick:
        a.rounds, a.size, sizes = 1, "256m", ["128k", "1m"]
    tmp = os.path.join(a.out, "rixl.json")
    # Lay the file out once with fio so both tools read the same allocated blocks.
    fio(path, "write", "1m", a.iodepth, a.size, a.cpu)
    res = {}
    for r in range(a.rounds):
        for rw in rws:
            for bs in sizes:
                order = [("fio", None), ("rixl", None)] if r % 2 == 0 else [("rixl", None), ("fio", None)]
                for tool, _ in order:
                    if tool == "fio":
                        v = fio(path, rw, bs, a.iodepth, a.size, a.cpu)
                    else:
                        v = rixl(a.rixl, path, rw, bs, a.iodepth, a.size, a.cpu, tmp)
                    res.setdefault((rw, bs, tool), []).append(v)
                print(f"round {r + 1}: {rw:9} {bs:>5}  fio {res[(rw, bs, 'fio')][-1]:8.1f}  "
                      f"rixl {res[(rw, bs, 'rixl')][-1]:8.1f} MiB/s", file=sys.stderr)
    rows = []
    for rw in rws:
        for bs in sizes:
            f = statistics.median(res[(rw, bs, "fio")])
            x = statistics.median(res[(rw, bs, "rixl")])
            rows.append((rw, bs, f, x, x / f))
    with open(os.path.join(a.out, "compare.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["rw", "bs", "fio_MiBps", "rixl_MiBps", "ratio"])
        for row in rows:
            w.writerow([row[0], row[1], f"{row[2]:.1f}", f"{row[3]:.1f}", f"{row[4]:.2f}"])
    md = [f"fio (io_uring, direct=1, fixedbufs, registerfiles) vs rixl-perf file, iodepth {a.iodepth}, size {a.size}, "
          f"median of {a.rounds} alternating rounds, file {path}", "",
          "| rw | bs | fio MiB/s | rixl MiB/s | rixl/fio |", "|---|---|---|---|---|"]
    md += [f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f} |" for r in rows]
    with open(os.path.join(a.out, "compare.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))
    os.remove(path)


if __name__ == "__main__":
    main()
