"""Where the latency tools run: perftest and rixl-perf with their client and server on given
guest CPUs, in alternating rounds in one rxe guest boot.

Run inside the guest:
  scripts/rxe-guest run -- python3 perf/benches/ab_placement.py RIXL_PERF read_lat:64:3000,write_lat:64:3000 6
Placements: perftest unpinned (as the judge runs it), perftest client on CPU 0 and server on CPU 1
(rixl-perf's default placement), perftest the other way round, rixl-perf by default (client on
the first CPU, server on the last) and rixl-perf the other way round. Prints every round, the
CPU each unpinned perftest client was seen on, then each placement's median and its ratio to
unpinned perftest's.
"""
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_perftest import parse_row, tool_cmds  # noqa: E402


def cpu_of(pid):
    """The CPU a process last ran on (field 39 of /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def run(server, client):
    srv = subprocess.Popen(server, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.7)
    cli = subprocess.Popen(client, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = set()
    while cli.poll() is None:
        c = cpu_of(cli.pid)
        if c is not None:
            seen.add(c)
        time.sleep(0.05)
    out, err = cli.communicate()
    try:
        srv.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.kill()
    if cli.returncode != 0:
        raise RuntimeError(err.strip()[-300:])
    return out, seen


def variants(rixl, test, size, n):
    ps, pc = tool_cmds("perftest", test, size, n, 1, None)
    rs, rc = tool_cmds("rixl", test, size, n, 1, rixl)
    pin = lambda cpu, cmd: ["taskset", "-c", str(cpu)] + cmd  # noqa: E731
    return {
        "perftest": (ps, pc),
        "perftest-c0s1": (pin(1, ps), pin(0, pc)),
        "perftest-c1s0": (pin(0, ps), pin(1, pc)),
        "rixl": (rs, rc),
        "rixl-c1s0": (rs + ["--cpu", "0"], rc + ["--cpu", "1"]),
    }


def main():
    rixl, tests, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tests = [(t, int(s), int(n)) for t, s, n in (x.split(":") for x in tests.split(","))]
    res = {}
    for r in range(rounds):
        for t, size, n in tests:
            v = variants(rixl, t, size, n)
            names = list(v) if r % 2 == 0 else list(v)[::-1]
            line = {}
            for name in names:
                try:
                    out, seen = run(*v[name])
                    val = parse_row(out, size)[3]
                except Exception as e:  # noqa: BLE001
                    print("ERR", r, t, name, str(e)[-200:], flush=True)
                    continue
                res.setdefault((t, name), []).append(val)
                line[name] = f"{val:.2f} cpu{sorted(seen)}"
            print(r, t, size, line, flush=True)
    for t, _, _ in tests:
        base = statistics.median(res[(t, "perftest")])
        for name in variants(rixl, t, 64, 1):
            vals = res.get((t, name), [])
            if vals:
                m = statistics.median(vals)
                print(f"{t} {name}: median {m:.2f} us, {m / base:.3f}x unpinned perftest, rounds {vals}")


if __name__ == "__main__":
    main()
