#!/usr/bin/env bash
# Looks for the 64 B message-rate stall (docs/perf.md) with ftrace in the rxe guest:
#   scripts/rxe-guest run -- bash perf/benches/stall_trace.sh [RUNS] [TOOLS]
# Each run is one 64 B write_bw -l 1 of 5,000 messages (server on vCPU 1, client on vCPU 0, as
# the judge's rounds), with the function tracer on the doorbell (rxe_post_send), rxe's two QP
# timers (retransmit_timer, rnr_nak_timer) and the CQ arm (rxe_req_notify_cq). Per run it
# prints the rate, the longest gap between two doorbells, which timers fired in the run and
# how long before the end of that gap. Traces go to target/ftrace/stall-*.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
runs=${1:-24}
tools=${2:-rixl}
RIXL=${RIXL:-target/cg/release/rixl-perf}
D=$RIXL_RDMA_DEVICE G=$RIXL_GID_INDEX
. perf/benches/ftrace.sh
ftrace_setup
OUT=target/ftrace
mkdir -p $OUT
printf '%s\n' rxe_post_send retransmit_timer rnr_nak_timer rxe_req_notify_cq > $T/set_ftrace_filter
echo function > $T/current_tracer
echo 32768 > $T/buffer_size_kb
for i in $(seq 1 "$runs"); do
  for tool in $tools; do
    if [ "$tool" = perftest ]; then b=(ib_write_bw); else b=("$RIXL" write_bw); fi
    echo > $T/trace
    timeout 120 taskset -c 1 "${b[@]}" -d "$D" -x "$G" -s 64 -n 5000 -F > /dev/null 2>&1 &
    sleep 0.8
    echo 1 > $T/tracing_on
    timeout 120 taskset -c 0 "${b[@]}" -d "$D" -x "$G" -s 64 -n 5000 -F 127.0.0.1 > /tmp/stall-cli.out 2>&1
    echo 0 > $T/tracing_on
    wait
    bw=$(awk '$1==64 {print $4}' /tmp/stall-cli.out)
    f=$OUT/stall-$tool-$i.trace
    cp $T/trace "$f"
    # The client's doorbells (its comm), the gaps between them, the timers' firings.
    awk -v tool="$tool" -v run="$i" -v bw="$bw" '
      /^#/ { next }
      {
        ts = ""; fn = ""
        for (k = 1; k <= NF; k++) if ($k ~ /^[0-9]+\.[0-9]+:$/) { ts = substr($k, 1, length($k) - 1); fn = $(k + 1); break }
        if (ts == "") next
        if (fn == "rxe_post_send") {
          posts++
          if (last != "" && ts - last > gap) { gap = ts - last; gap_end = ts; gap_start = last }
          last = ts
        } else if (fn == "retransmit_timer") { rt++; rts[rt] = ts }
        else if (fn == "rnr_nak_timer") rnr++
        else if (fn == "rxe_req_notify_cq") arms++
      }
      END {
        near = "-"
        for (k = 1; k <= rt; k++) if (rts[k] >= gap_start && rts[k] <= gap_end) near = sprintf("%.2f ms before its end", (gap_end - rts[k]) * 1000)
        printf "%s run %d: %s MiB/s, %d doorbells, longest gap %.2f ms, retransmit_timer %d, rnr_nak_timer %d, cq arms %d, a retransmit timer in the gap: %s\n", tool, run, bw, posts, gap * 1000, rt, rnr + 0, arms + 0, near
      }' "$f"
  done
done
echo nop > $T/current_tracer
