#!/usr/bin/env python3
"""Side-by-side comparison of perftest and rixl-perf on the same RDMA device in ONE boot.

Runs inside the rxe guest (benches/compare-perftest boots it). For every test and size it runs
perftest and rixl-perf alternately for --rounds rounds (--lat-rounds for latency; same sizes, iterations, tx depth and post
list) and compares medians, and the median of each round's paired ratio (the tools ran back to
back in it). Writes target/compare/compare.csv, compare.md and bandwidth.svg.
"""
import argparse
import csv
import os
import statistics
import subprocess
import sys
import time

DEV = os.environ.get("RIXL_RDMA_DEVICE", "rxe0")
GID = os.environ.get("RIXL_GID_INDEX", "1")


def run_pair(server_cmd, client_cmd, timeout=180):
    srv = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.7)
    try:
        # A slow boot may not have the server listening yet: retry a refused connection.
        for attempt in range(4):
            out = subprocess.run(client_cmd, capture_output=True, text=True, timeout=timeout)
            refused = "connect" in (out.stderr + out.stdout).lower() and srv.poll() is None
            if out.returncode == 0 or not refused or attempt == 3:
                break
            time.sleep(1.0)
    finally:
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(client_cmd)} failed: {out.stderr.strip()[-400:]}")
    return out.stdout


def parse_row(text, size):
    """Returns the numeric columns of perftest's result row for `size`."""
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 5 and f[0] == str(size):
            try:
                return [float(x) for x in f[1:]]
            except ValueError:
                continue
    raise RuntimeError(f"no result row for {size} in:\n{text}")


def tool_cmds(tool, test, size, iters, post_list, rixl, extra=()):
    if tool == "perftest":
        base = ["timeout", "150", f"ib_{test}", "-d", DEV, "-x", GID, "-s", str(size), "-n", str(iters), "-F"]
        if post_list > 1:
            base += ["-l", str(post_list)]
    else:
        base = [rixl, test, "-d", DEV, "-x", GID, "-s", str(size), "-n", str(iters), "-F"]
        if post_list > 1:
            base += ["-l", str(post_list)]
    base += list(extra)
    return base, base + ["127.0.0.1"]


def tuned_flags(test, size, post_list):
    """rixl-perf's opt-in engine features for a row, or None: prepared transfers (checked and
    planned once, re-posted) for one-descriptor READ/WRITE bandwidth up to 64 KiB and write
    latency. (Coalesced doorbells, once an opt-in here, are the engine's default.)"""
    if test in ("write_bw", "read_bw") and post_list == 1 and size <= 65536:
        return ["--prepared"]
    if test == "write_lat":
        return ["--prepared"]
    return None


def rxe_retries():
    """The device's count of transport retries (rxe's `completer_retry_err`: a request sent
    again after its ACK was late or a NAK came), or None where the counter is absent. rxe
    retries now and then for either tool, and a retry can cost a round tens of milliseconds, so
    each round's count is printed beside its rate."""
    path = f"/sys/class/infiniband/{DEV}/ports/1/hw_counters/completer_retry_err"
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def measure(tool, test, size, iters, post_list, rixl, extra=()):
    iters = -(-iters // post_list) * post_list  # perftest wants a multiple of the post list
    s, c = tool_cmds(tool, test, size, iters, post_list, rixl, extra)
    before = rxe_retries()
    row = parse_row(run_pair(s, c), size)
    after = rxe_retries()
    retries = after - before if before is not None and after is not None else None
    if test.endswith("_bw"):
        return {"bw_avg": row[2], "msg_rate": row[3], "retries": retries}  # MiB/s, Mpps
    return {"t_typical": row[3], "t_avg": row[4], "p99": row[6], "retries": retries}


def perftest_op_time(size, iters):
    """Raw verbs time per completed WRITE: ib_write_bw with one request outstanding (-t 1) posts,
    then polls until its completion, like one `.await`; 1 / MsgRate in microseconds."""
    s, c = tool_cmds("perftest", "write_bw", size, iters, 1, None, ["-t", "1"])
    row = parse_row(run_pair(s, c), size)
    # A run that printed a zero message rate (it happens on a stalled guest) has no time per op.
    return 1.0 / row[3] if row[3] > 0 else None


def rixl_lat_imm(rixl, size, iters):
    """rixl's write_lat with WRITE_WITH_IMM and a receive completion as the arrival signal."""
    s, c = tool_cmds("rixl", "write_lat", size, iters, 1, rixl, ["--notify", "imm"])
    return parse_row(run_pair(s, c), size)[3]


def await_latency(rixl, size, iters):
    s, c = tool_cmds("rixl", "write_lat", size, iters, 1, rixl)
    out = run_pair(s, c)
    for line in out.splitlines():
        if line.startswith("# rixl: one .await"):
            return float(line.split("t_typical")[1].split()[0])
    raise RuntimeError("no .await line")


def svg_plot(rows, path):
    """Bandwidth vs message size, both tools (log2 x axis), as a small hand-written SVG."""
    pts = {}
    for r in rows:
        if r["test"] == "write_bw" and r["post_list"] == 1:
            pts.setdefault(r["size"], r)  # one point per size (the bandwidth run's)
    pts = list(pts.values())
    if not pts:
        return
    W, H, L, B = 720, 420, 70, 50
    sizes = sorted({r["size"] for r in pts})
    ymax = max(max(r["perftest"], r["rixl"]) for r in pts) * 1.15
    import math
    x0, x1 = math.log2(sizes[0]), math.log2(sizes[-1]) if len(sizes) > 1 else math.log2(sizes[0]) + 1
    def X(s):
        return L + (math.log2(s) - x0) / max(x1 - x0, 1e-9) * (W - L - 20)
    def Y(v):
        return H - B - v / ymax * (H - B - 30)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W/2}" y="18" text-anchor="middle" font-size="14">RDMA WRITE bandwidth on rxe (same boot): perftest vs rixl</text>',
           f'<line x1="{L}" y1="{H-B}" x2="{W-10}" y2="{H-B}" stroke="black"/>',
           f'<line x1="{L}" y1="{H-B}" x2="{L}" y2="20" stroke="black"/>',
           f'<text x="{W/2}" y="{H-10}" text-anchor="middle">message size (bytes)</text>',
           f'<text x="15" y="{H/2}" transform="rotate(-90 15 {H/2})" text-anchor="middle">MiB/s (median)</text>']
    for s in sizes:
        out.append(f'<text x="{X(s)}" y="{H-B+16}" text-anchor="middle">{s if s < 1024 else (str(s//1024)+"K" if s < 1<<20 else str(s>>20)+"M")}</text>')
    for k in range(6):
        v = ymax * k / 5
        out.append(f'<text x="{L-6}" y="{Y(v)+4}" text-anchor="end">{v:.0f}</text>')
        out.append(f'<line x1="{L}" y1="{Y(v)}" x2="{W-10}" y2="{Y(v)}" stroke="#ddd"/>')
    for key, color in (("perftest", "#d62728"), ("rixl", "#1f77b4")):
        p = " ".join(f"{X(r['size']):.1f},{Y(r[key]):.1f}" for r in sorted(pts, key=lambda r: r["size"]))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{p}"/>')
        for r in pts:
            out.append(f'<circle cx="{X(r["size"]):.1f}" cy="{Y(r[key]):.1f}" r="3" fill="{color}"/>')
    out.append(f'<text x="{W-150}" y="40" fill="#d62728">ib_write_bw</text><text x="{W-150}" y="56" fill="#1f77b4">rixl-perf write_bw</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rixl")
    ap.add_argument("--baseline", help="a second rixl-perf (an earlier build), measured in the same rounds, alternating with the others")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lat-rounds", type=int, default=7,
                    help="rounds for the latency rows (short runs whose t_typical jumps between two levels from run to run in the emulated guest, for perftest as for rixl)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations (smoke run)")
    ap.add_argument("--from-csv", help="only redraw the plot from an earlier compare.csv")
    a = ap.parse_args()
    if a.from_csv:
        with open(a.from_csv) as f:
            rows = [{"test": r["test"], "size": int(r["size"]), "post_list": int(r["post_list"]),
                     "perftest": float(r["perftest"]), "rixl": float(r["rixl"])}
                    for r in csv.DictReader(f) if r["test"].endswith("_bw")]
        svg_plot(rows, os.path.join(a.out, "bandwidth.svg"))
        return
    os.makedirs(a.out, exist_ok=True)
    budget = (32 << 20) if a.quick else (96 << 20)
    bw_sizes = [4096, 65536, 1 << 20] if a.quick else [4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 8 << 20]
    rate_sizes = [64] if a.quick else [64, 512, 4096]
    lat_sizes = [64, 4096]
    plan = []
    for test in ("write_bw", "read_bw", "send_bw"):
        for size in bw_sizes:
            if test == "send_bw" and size > (1 << 20):
                continue  # rixl messages are at most 1 MiB
            iters = int(min(5000, max(64, budget // size)))
            plan.append((test, size, iters, 1))
            if size <= 16384 and test != "send_bw":
                plan.append((test, size, iters, 8))
    for size in rate_sizes:
        plan.append(("write_bw", size, 5000 if a.quick else 20000, 1))
        plan.append(("write_bw", size, 5000 if a.quick else 20000, 16))
    for size in lat_sizes:
        plan.append(("write_lat", size, 300 if a.quick else 1000, 1))
    plan.append(("read_lat", 64, 300 if a.quick else 1000, 1))
    plan.append(("send_lat", 64, 300 if a.quick else 1000, 1))
    rows = []
    for test, size, iters, pl in plan:
        tuned = tuned_flags(test, size, pl)
        res = {"perftest": [], "rixl": []}
        if tuned:
            res["tuned"] = []
        if a.baseline:
            res["baseline"] = []
        rounds = a.lat_rounds if test.endswith("_lat") else a.rounds
        for _ in range(rounds):
            for tool in ("perftest", "rixl"):
                res[tool].append(measure(tool, test, size, iters, pl, a.rixl))
            if tuned:
                res["tuned"].append(measure("rixl", test, size, iters, pl, a.rixl, tuned))
            if a.baseline:
                res["baseline"].append(measure("rixl", test, size, iters, pl, a.baseline))
        key = "bw_avg" if test.endswith("_bw") else "t_typical"
        med = {t: statistics.median(x[key] for x in res[t]) for t in res}
        r = {"test": test, "size": size, "iters": iters, "post_list": pl, "metric": key,
             "perftest": med["perftest"], "rixl": med["rixl"],
             "perftest_all": [x[key] for x in res["perftest"]], "rixl_all": [x[key] for x in res["rixl"]]}
        if test.endswith("_bw"):
            r["perftest_mpps"] = statistics.median(x["msg_rate"] for x in res["perftest"])
            r["rixl_mpps"] = statistics.median(x["msg_rate"] for x in res["rixl"])
        # ratio: rixl over perftest (bandwidth: >1 is better; latency: <1 is better)
        r["ratio"] = r["rixl"] / r["perftest"]
        # The same, paired within each round (the two tools ran back to back): the median of
        # the rounds' ratios, which a boot's drift between rounds moves less than the ratio of
        # medians; and in how many rounds rixl was at least perftest's level.
        pairs = [x[key] / y[key] for x, y in zip(res["rixl"], res["perftest"]) if y[key] > 0]
        if pairs:
            r["paired"] = statistics.median(pairs)
            better = (lambda q: q >= 1.0) if test.endswith("_bw") else (lambda q: q <= 1.0)
            r["rounds_ahead"] = f"{sum(1 for q in pairs if better(q))}/{len(pairs)}"
        if a.baseline:
            r["baseline"] = med["baseline"]
            r["baseline_ratio"] = r["baseline"] / r["perftest"]
            r["baseline_all"] = [x[key] for x in res["baseline"]]
        if tuned:
            r["tuned"] = med["tuned"]
            r["tuned_flags"] = " ".join(tuned)
            r["tuned_ratio"] = r["tuned"] / r["perftest"]
        rows.append(r)
        unit = "MiB/s" if test.endswith("_bw") else "us"
        also = f"  rixl {r['tuned_flags']} {r['tuned']:.2f} = {r['tuned_ratio']:.2f}" if tuned else ""
        if a.baseline:
            also += f"  baseline {r['baseline']:.2f} = {r['baseline_ratio']:.2f} (rounds {r['baseline_all']})"
        paired = f" (paired {r['paired']:.2f}, at perftest's level in {r['rounds_ahead']} rounds)" if "paired" in r else ""
        retries = {t: [x["retries"] for x in res[t]] for t in ("perftest", "rixl")}
        print(f"{test:9} {size:>8} B  -l {pl:<2} n={iters:<5}  perftest {r['perftest']:9.2f}  rixl {r['rixl']:9.2f} {unit:5}  rixl/perftest {r['ratio']:.2f}{paired}{also}   (rounds: perftest {r['perftest_all']}, rixl {r['rixl_all']}; rxe retries per round: perftest {retries['perftest']}, rixl {retries['rixl']})", flush=True)
    awaits = []
    extra = []
    for size in lat_sizes:
        n = 300 if a.quick else 1000
        vals, ops, imms = [], [], []
        for _ in range(a.lat_rounds):
            vals.append(await_latency(a.rixl, size, n))
            op = perftest_op_time(size, 2 * n)
            if op is None:
                print(f"ib_write_bw -t 1 {size} B: a zero message rate, round left out", flush=True)
            else:
                ops.append(op)
            imms.append(rixl_lat_imm(a.rixl, size, n))
        v, op, imm = statistics.median(vals), statistics.median(ops), statistics.median(imms)
        pt = next(r for r in rows if r["test"] == "write_lat" and r["size"] == size)["perftest"]
        awaits.append((size, v, pt))
        extra.append((size, v, op, imm, pt))
        print(f"one .await of a {size} B WRITE: t_typical {v:.2f} us = {v/pt:.2f} x ib_write_lat one-way t_typical ({pt:.2f} us); "
              f"raw verbs post+completion (ib_write_bw -t 1): {op:.2f} us/op, so the .await is {v/op:.2f} x that", flush=True)
        print(f"write_lat {size} B with WRITE_WITH_IMM arrival (--notify imm): {imm:.2f} us = {imm/pt:.2f} x ib_write_lat", flush=True)
    with open(os.path.join(a.out, "compare.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["test", "size", "iterations", "post_list", "metric", "perftest", "rixl", "rixl_over_perftest", "perftest_mpps", "rixl_mpps", "rixl_tuned_flags", "rixl_tuned", "rixl_tuned_over_perftest", "baseline", "baseline_over_perftest", "paired_rixl_over_perftest", "rounds_at_perftest_level"])
        for r in rows:
            t = [r["tuned_flags"], f"{r['tuned']:.3f}", f"{r['tuned_ratio']:.3f}"] if "tuned" in r else ["", "", ""]
            b = [f"{r['baseline']:.3f}", f"{r['baseline_ratio']:.3f}"] if "baseline" in r else ["", ""]
            p = [f"{r['paired']:.3f}", r["rounds_ahead"]] if "paired" in r else ["", ""]
            w.writerow([r["test"], r["size"], r["iters"], r["post_list"], r["metric"], f"{r['perftest']:.3f}", f"{r['rixl']:.3f}", f"{r['ratio']:.3f}", r.get("perftest_mpps", ""), r.get("rixl_mpps", "")] + t + b + p)
        for size, v, op, imm, pt in extra:
            w.writerow(["await_write", size, "", 1, "t_typical_over_write_lat_oneway", f"{pt:.3f}", f"{v:.3f}", f"{v/pt:.3f}", "", ""])
            w.writerow(["await_write_vs_verbs_op", size, "", 1, "t_typical_over_ib_write_bw_t1_per_op", f"{op:.3f}", f"{v:.3f}", f"{v/op:.3f}", "", ""])
            w.writerow(["write_lat_imm", size, "", 1, "t_typical", f"{pt:.3f}", f"{imm:.3f}", f"{imm/pt:.3f}", "", ""])
    with open(os.path.join(a.out, "compare.md"), "w") as f:
        base_head = " baseline/perftest |" if a.baseline else ""
        f.write(f"| test | size (B) | -l | perftest | rixl | rixl/perftest | paired per round (rounds at perftest's level) |{base_head} rixl with opt-ins (flags) | opt-ins/perftest |\n|---|---|---|---|---|---|---|{'---|' if a.baseline else ''}---|---|\n")
        for r in rows:
            unit = "MiB/s" if r["test"].endswith("_bw") else "µs t_typical"
            t = f"{r['tuned']:.2f} {unit} (`{r['tuned_flags']}`) | {r['tuned_ratio']:.2f}" if "tuned" in r else " | "
            b = f" {r['baseline_ratio']:.2f} |" if "baseline" in r else ""
            p = f" {r['paired']:.2f} ({r['rounds_ahead']}) |" if "paired" in r else " |"
            f.write(f"| {r['test']} | {r['size']} | {r['post_list']} | {r['perftest']:.2f} {unit} | {r['rixl']:.2f} {unit} | {r['ratio']:.2f} |{p}{b} {t} |\n")
        # The extra rows leave the paired, baseline and opt-in cells empty.
        empty = " |" * (3 + (1 if a.baseline else 0))
        for size, v, op, imm, pt in extra:
            f.write(f"| one `.await` WRITE | {size} | 1 | {pt:.2f} µs (ib_write_lat one-way) | {v:.2f} µs | {v/pt:.2f}x |{empty}\n")
            f.write(f"| one `.await` WRITE vs raw verbs post+completion | {size} | 1 | {op:.2f} µs (ib_write_bw -t 1, per op) | {v:.2f} µs | {v/op:.2f}x |{empty}\n")
            f.write(f"| write_lat, rixl arrival by WRITE_WITH_IMM | {size} | 1 | {pt:.2f} µs | {imm:.2f} µs | {imm/pt:.2f} |{empty}\n")
    svg_plot(rows, os.path.join(a.out, "bandwidth.svg"))
    print(f"wrote {a.out}/compare.csv, compare.md, bandwidth.svg")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # surface the reason (and where), fail the run
        import traceback
        traceback.print_exc()
        print(f"compare-perftest: {e}", file=sys.stderr)
        sys.exit(1)
