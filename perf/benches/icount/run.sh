#!/usr/bin/env bash
# Runs perftest and rixl-perf between icount markers (client on vCPU 0, server on vCPU 1), each
# with N1 and N2 messages, and records which marker ends which run; see README.md.
# Environment: T (test, write_bw), S (size, 64), N1/N2 (messages, 5000/20000), TOOLS
# ("perftest rixl"), RIXL_BIN (target/cg/release/rixl-perf), EXTRA (flags for both tools),
# OUT (target/exp/ic).
set -u
D=$RIXL_RDMA_DEVICE G=$RIXL_GID_INDEX S=${S:-64} T=${T:-write_bw}
O=${OUT:-target/exp/ic}
M=target/exp/icount-mark
mkdir -p "$O"
: >"$O/marks.txt"
k=0
mark() { "$M"; k=$((k + 1)); }
for n in ${N1:-5000} ${N2:-20000}; do
  for tool in ${TOOLS:-perftest rixl}; do
    if [ "$tool" = perftest ]; then b=("ib_$T"); else b=("${RIXL_BIN:-target/cg/release/rixl-perf}" "$T"); fi
    # shellcheck disable=SC2086 # EXTRA is a list of flags
    taskset -c 1 "${b[@]}" -d "$D" -x "$G" -s "$S" -n "$n" -F ${EXTRA:-} >/dev/null 2>&1 &
    sleep 0.8
    mark
    # shellcheck disable=SC2086
    taskset -c 0 "${b[@]}" -d "$D" -x "$G" -s "$S" -n "$n" -F ${EXTRA:-} 127.0.0.1 >"$O/$tool-$n.out" 2>&1 &
    sleep 0.5
    cat "/proc/$!/maps" >"$O/$tool-$T.maps" 2>/dev/null
    wait
    mark
    grep "^ *$S " "$O/$tool-$n.out"
    echo "$tool $n $((k - 1))" >>"$O/marks.txt"
  done
done
