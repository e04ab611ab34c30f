#!/usr/bin/env bash
# Runs perftest and rixl-perf between icount markers (client on vCPU 0, server on vCPU 1), each
# with a short and a long run, and records which marker ends which run, with the guest's
# kernel symbols; see README.md.
# Environment (RIXL_ variables reach the guest): RIXL_IC_TEST (write_bw), RIXL_IC_SIZE (64),
# RIXL_IC_SHORT/RIXL_IC_LONG (messages, 5000/20000), RIXL_IC_TOOLS ("perftest rixl"), RIXL_IC_BIN
# (target/cg/release/rixl-perf), RIXL_IC_EXTRA (flags for both tools), RIXL_IC_OUT (target/exp/ic).
set -u
D=$RIXL_RDMA_DEVICE G=$RIXL_GID_INDEX S=${RIXL_IC_SIZE:-64} T=${RIXL_IC_TEST:-write_bw}
O=${RIXL_IC_OUT:-target/exp/ic}
M=target/exp/icount-mark
mkdir -p "$O"
: >"$O/marks.txt"
cat /proc/kallsyms >"$O/kallsyms"
k=0
mark() { "$M"; k=$((k + 1)); }
for n in ${RIXL_IC_SHORT:-5000} ${RIXL_IC_LONG:-20000}; do
  for tool in ${RIXL_IC_TOOLS:-perftest rixl}; do
    if [ "$tool" = perftest ]; then b=("ib_$T"); else b=("${RIXL_IC_BIN:-target/cg/release/rixl-perf}" "$T"); fi
    # shellcheck disable=SC2086 # EXTRA is a list of flags
    taskset -c 1 "${b[@]}" -d "$D" -x "$G" -s "$S" -n "$n" -F ${RIXL_IC_EXTRA:-} >/dev/null 2>&1 &
    server=$!
    sleep 0.8
    cat "/proc/$server/maps" >"$O/$tool-$T-server.maps" 2>/dev/null
    mark
    # shellcheck disable=SC2086
    taskset -c 0 "${b[@]}" -d "$D" -x "$G" -s "$S" -n "$n" -F ${RIXL_IC_EXTRA:-} 127.0.0.1 >"$O/$tool-$n.out" 2>&1 &
    sleep 0.5
    cat "/proc/$!/maps" >"$O/$tool-$T.maps" 2>/dev/null
    wait
    mark
    grep "^ *$S " "$O/$tool-$n.out"
    echo "$tool $n $((k - 1))" >>"$O/marks.txt"
  done
done
