D=$RIXL_RDMA_DEVICE G=$RIXL_GID_INDEX
for tool in perftest rixl; do
  if [ $tool = perftest ]; then b=(ib_read_lat); else b=(target/exp/rixl-perf-lone read_lat); fi
  taskset -c 1 "${b[@]}" -d $D -x $G -s 64 -n 3000 -F >/dev/null 2>&1 &
  sleep 1
  perf record -q -a -C 0 -e sched:sched_switch,sched:sched_wakeup,raw_syscalls:sys_enter,raw_syscalls:sys_exit,irq:softirq_entry,irq:softirq_exit -o /tmp/$tool.data -- taskset -c 0 "${b[@]}" -d $D -x $G -s 64 -n 3000 -F 127.0.0.1 > /tmp/$tool.out 2>&1
  wait
  echo "== $tool"; grep -E "^ *64 " /tmp/$tool.out
  perf script -i /tmp/$tool.data -F comm,tid,cpu,time,event,trace 2>/dev/null > target/exp/tl-$tool.txt
  wc -l target/exp/tl-$tool.txt
done
