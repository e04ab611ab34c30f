# Sourced by the ftrace scripts here (stall_trace.sh, send_lat_hops.sh, read_lat_kernel.sh):
# ftrace_setup sets T to tracefs (mounting it if needed), stops tracing and clears the tracer.
ftrace_setup() {
  T=/sys/kernel/tracing
  mountpoint -q $T || mount -t tracefs nodev $T
  echo 0 > $T/tracing_on
  echo nop > $T/current_tracer
}
