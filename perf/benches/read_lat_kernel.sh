#!/bin/bash
# The kernel's side of a 64 B read_lat READ, perftest against rixl-perf, in the rxe guest:
#   scripts/rxe-guest run -- bash perf/benches/read_lat_kernel.sh stat|sched|rxe|gran
# stat:  perf stat -a of context switches, wake-ups, softirqs, timer and IPI interrupts and
#        system calls per READ, then strace -c of each client;
# sched: perf record -a of wake-ups, switches and softirqs, summarised by task and vector;
# rxe:   ftrace's function tracer on rdma_rxe's functions, calls per READ and the task they ran in;
# gran:  the scheduler's wake-up granularity at its default and at 200 ms, alternating rounds;
# raise: perf record -g of every TASKLET raise and every ksoftirqd wake-up, perftest pinned as
#        rixl-perf pins itself (client vCPU 0, server vCPU 1), counted by kernel call chain.
# Per-READ figures divide by -n; rixl-perf runs a tenth more READs as warm-up (divide by 1.1).
# Uses target/release/rixl-perf (RIXL=...).
set -u
D="-d ${RIXL_RDMA_DEVICE:-rxe0} -x ${RIXL_GID_INDEX:-1} -s 64 -F"
mode=${1:-stat}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
R=$(realpath "${RIXL:-target/release/rixl-perf}")
cmd() { if [ "$1" = perftest ]; then echo "ib_read_lat $D -n $2"; else echo "$R read_lat $D -n $2"; fi; }
case $mode in
stat)
  N=5000
  cat /proc/cmdline
  cat /sys/devices/system/clocksource/clocksource0/current_clocksource
  grep -E 'LOC|TLB|RES|CAL|HPET|timer' /proc/interrupts
  ev=context-switches,cpu-migrations,page-faults,raw_syscalls:sys_enter,irq_vectors:local_timer_entry,irq_vectors:reschedule_entry,irq_vectors:call_function_entry,irq_vectors:call_function_single_entry,timer:hrtimer_start,timer:hrtimer_expire_entry,irq:softirq_entry,tlb:tlb_flush,sched:sched_wakeup
  for tool in perftest rixl perftest rixl; do
    S=$(cmd $tool $N)
    $S >/dev/null 2>&1 & sp=$!
    sleep 0.7
    echo "== $tool"
    perf stat -a -e $ev -x, -o /tmp/ps.$tool $S 127.0.0.1 2>&1 | grep -E '^ *64 ' 
    cat /tmp/ps.$tool | grep -v '^#' | awk -F, -v n=$N '{printf "  %-45s %10s  %.3f/READ\n", $3, $1, $1/n}'
    wait $sp
  done
  for tool in perftest rixl; do
    S=$(cmd $tool $N)
    $S >/dev/null 2>&1 & sp=$!
    sleep 0.7
    echo "== strace $tool"
    strace -f -c -o /tmp/st.$tool $S 127.0.0.1 >/dev/null 2>&1
    head -25 /tmp/st.$tool
    wait $sp
  done
  ;;
sched)
  N=5000
  cd /tmp
  for tool in perftest rixl perftest rixl; do
    S=$(cmd $tool $N)
    $S >/dev/null 2>&1 & sp=$!
    sleep 0.7
    echo "== $tool"
    perf record -q -a -e sched:sched_wakeup,sched:sched_switch,irq:softirq_entry -o /tmp/pr.$tool $S 127.0.0.1 2>&1 | grep -E '^ *64 '
    wait $sp
    perf script -i /tmp/pr.$tool -F comm,tid,cpu,event,trace 2>/dev/null > /tmp/ps.txt
    echo "-- wakeups by wakee (per READ)"
    grep 'sched_wakeup' /tmp/ps.txt | sed -E -e 's/.*comm=([^ ]+) pid=([0-9]+).*target_cpu=([0-9]+).*/\1 cpu\3/' -e 't' -e 's/.*sched_wakeup: *([^:]+):([0-9]+).*CPU:([0-9]+).*/\1 cpu\3/' | sort | uniq -c | sort -rn | head -8 | awk -v n=$N '{printf "  %8d %.3f %s %s\n", $1, $1/n, $2, $3}'
    echo "-- wakeups by waker"
    grep 'sched_wakeup' /tmp/ps.txt | awk '{print $1}' | sort | uniq -c | sort -rn | head -6 | awk -v n=$N '{printf "  %8d %.3f %s\n", $1, $1/n, $2}'
    echo "-- softirqs by vector, cpu"
    grep 'softirq_entry' /tmp/ps.txt | sed -E 's/^ *([^ ]+) +[0-9]+ +\[([0-9]+)\].*action=([A-Z_]+).*/\3 cpu\2 in:\1/' | sort | uniq -c | sort -rn | head -10 | awk -v n=$N '{printf "  %8d %.3f %s %s %s\n", $1, $1/n, $2, $3, $4}'
    echo "-- switches by prev -> next"
    grep 'sched_switch' /tmp/ps.txt | sed -E 's/.*prev_comm=([^ ]+) .*next_comm=([^ ]+) .*/\1 -> \2/' | sort | uniq -c | sort -rn | head -8 | awk -v n=$N '{printf "  %8d %.3f %s %s %s\n", $1, $1/n, $2, $3, $4}'
  done
  ;;
rxe)
  N=3000
  . perf/benches/ftrace.sh
  ftrace_setup
  echo 60000 > $T/buffer_size_kb
  echo "rxe_*" > $T/set_ftrace_filter
  wc -l < $T/set_ftrace_filter
  echo function > $T/current_tracer
  for tool in perftest rixl perftest rixl; do
    S=$(cmd $tool $N)
    $S >/dev/null 2>&1 & sp=$!
    sleep 0.7
    echo "== $tool"
    echo > $T/trace
    echo 1 > $T/tracing_on
    $S 127.0.0.1 2>&1 | grep -E '^ *64 '
    echo 0 > $T/tracing_on
    wait $sp
    grep -v '^#' $T/trace > /tmp/tr.txt
    wc -l < /tmp/tr.txt
    # function name and the task it ran in
    awk -v n=$N '{for (i=1;i<=NF;i++) if ($i ~ /^[0-9]+\.[0-9]+:$/) { f=$(i+1); break }; task=$1; sub(/-[0-9]+$/, "", task); c[f" "task]++} END {for (k in c) if (c[k]/n > 0.02) printf "  %-60s %8d %.3f/READ\n", k, c[k], c[k]/n}' /tmp/tr.txt | sort
  done
  ;;
gran)
  # The scheduler's wake-up granularity (debugfs) at its default and at 200 ms, alternating:
  # t_typical and context switches per READ (rixl-perf's divided by 1.1 for its warm-up).
  N=3000
  mountpoint -q /sys/kernel/debug || mount -t debugfs none /sys/kernel/debug
  G=/sys/kernel/debug/sched/wakeup_granularity_ns
  def=$(cat $G)
  echo "default granularity $def ns"
  for r in 1 2 3 4; do
    for g in $def 200000000; do
      echo $g > $G
      for tool in perftest rixl; do
        S=$(cmd $tool $N)
        $S >/dev/null 2>&1 & sp=$!
        sleep 0.7
        out=$(perf stat -a -e context-switches -x, -o /tmp/cs $S 127.0.0.1 2>&1 | grep -E '^ *64 ')
        wait $sp
        cs=$(grep context-switches /tmp/cs | cut -d, -f1)
        echo "round $r gran $g $tool t_typical $(echo $out | awk '{print $5}') switches/READ $(awk -v c=$cs -v n=$N -v t=$tool 'BEGIN{printf "%.3f", c/n/(t=="rixl"?1.1:1)}')"
      done
    done
  done
  echo $def > $G
  ;;
raise)
  N=3000
  cd /tmp
  for tool in perftest rixl perftest rixl; do
    S=$(cmd $tool $N)
    # perftest placed as rixl-perf places itself (rixl-perf pins its own engines)
    srv=(); cli=(); [ $tool = perftest ] && srv=(taskset -c 1) cli=(taskset -c 0)
    "${srv[@]}" $S >/dev/null 2>&1 & sp=$!
    sleep 0.7
    echo "== $tool"
    perf record -q -a -g -e irq:softirq_raise --filter 'vec == 6' -e sched:sched_wakeup --filter 'comm ~ "ksoftirqd*"' \
      -o /tmp/pr.$tool "${cli[@]}" $S 127.0.0.1 2>&1 | grep -E '^ *64 '
    wait $sp
    # one line per event: event name, then its kernel frames (innermost first), below the event
    perf script -i /tmp/pr.$tool -F event,ip,sym 2>/dev/null | awk '
      /^ *[a-z_]+:[a-z_]+:/ { if (ev != "") print ev " |" st; ev=$1; st=""; next }
      NF >= 2 { st = st " " $2 }
      END { if (ev != "") print ev " |" st }' > /tmp/chains.txt
    echo "-- events per READ"
    awk '{print $1}' /tmp/chains.txt | sort | uniq -c | awk -v n=$N '{printf "  %8d %.3f %s\n", $1, $1/n, $2}'
    echo "-- call chains (first 9 frames) per READ"
    awk '{ out=$1 " |"; k=0; for (i=3; i<=NF && k<9; i++) { if ($i ~ /^(perf_trace|trace_event|__traceiter|perf_tp|perf_swevent)/) continue; out=out " " $i; k++ }; print out }' /tmp/chains.txt \
      | sort | uniq -c | sort -rn | head -12 | awk -v n=$N '{c=$1; $1=""; printf "  %8d %.3f%s\n", c, c/n, $0}'
  done
  ;;
*) echo "usage: read_lat_kernel.sh stat|sched|rxe|gran|raise" >&2; exit 2 ;;
esac
