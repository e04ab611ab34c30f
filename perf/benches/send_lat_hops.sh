#!/usr/bin/env bash
# Per-hop view of 64 B send_lat, perftest against rixl-perf, with ftrace in the rxe guest:
#   scripts/rxe-guest run -- bash perf/benches/send_lat_hops.sh [hops|graph] [ROUNDS]
# hops (default): only rxe_post_send is traced (function_graph depth 1, absolute times): each
#   side's post (the kernel's whole loopback path) and the gap from one side's post to the
#   other's next post (its completion found, user space, then its post).
# graph: every rxe_* function under rxe_post_send, summed per post (tracing inflates it ~6x).
# Uses target/cg/release/rixl-perf (RIXL=...); traces go to target/ftrace/, summaries to stdout.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mode=${1:-hops}
rounds=${2:-3}
RIXL=${RIXL:-target/cg/release/rixl-perf}
. perf/benches/ftrace.sh
ftrace_setup
OUT=target/ftrace
mkdir -p $OUT
if [ "$mode" = graph ]; then
  echo 'rxe_*' > $T/set_ftrace_filter
  echo try_to_wake_up >> $T/set_ftrace_filter
  echo __tasklet_schedule >> $T/set_ftrace_filter
  echo rxe_post_send > $T/set_graph_function
  echo 20 > $T/max_graph_depth
else
  echo rxe_post_send > $T/set_ftrace_filter
  echo 1 > $T/max_graph_depth
fi
echo function_graph > $T/current_tracer
echo funcgraph-proc > $T/trace_options
echo funcgraph-tail > $T/trace_options
echo funcgraph-abstime > $T/trace_options
echo 65536 > $T/buffer_size_kb
run() { # name cmd... (the server runs cmd, the client cmd 127.0.0.1)
  local name=$1
  shift
  echo > $T/trace
  "$@" > $OUT/$name.srv.log 2>&1 &
  sleep 0.7
  echo 1 > $T/tracing_on
  "$@" 127.0.0.1 > $OUT/$name.cli.log 2>&1
  echo 0 > $T/tracing_on
  wait
  cp $T/trace $OUT/$name.trace
  echo "$name: $(grep -A1 '#bytes' $OUT/$name.cli.log | tail -1)"
}
traces=()
for r in $(seq "$rounds"); do
  run perftest$r ib_send_lat -d rxe0 -x 1 -s 64 -n 1000 -F
  run rixl$r "$RIXL" send_lat -d rxe0 -x 1 -s 64 -n 1000 -F
  traces+=("$OUT/perftest$r.trace" "$OUT/rixl$r.trace")
done
echo nop > $T/current_tracer
python3 perf/benches/send_lat_hops.py "--$mode" "${traces[@]}"
