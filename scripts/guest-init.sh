#!/bin/sh
# /init of the rxe guest (busybox). Loads rxe, mounts the host root read-only over virtio-9p,
# chroots into it and runs the job written by scripts/rxe-guest. Writes the job's exit status to
# $job/status and prints a final status line, then powers off.
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo /sbin/modprobe >/proc/sys/kernel/modprobe

say() { echo "[guest] $*"; }
fail() { say "FAILED: $*"; echo "RIXL-GUEST-RESULT: setup-failed"; sync; poweroff -f; sleep 5; }

job=$(tr ' ' '\n' </proc/cmdline | sed -n 's/^rixl.job=//p')
idx=$(tr ' ' '\n' </proc/cmdline | sed -n 's/^rixl.index=//p')

for m in virtio_pci 9pnet_virtio 9p udp_tunnel ip6_udp_tunnel crc32_generic ib_core ib_uverbs rdma_rxe dummy virtio_net; do
  modprobe "$m" || fail "modprobe $m"
done

H=/host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot $H || fail "mount host root"
# Read the job (it lives in the workspace) before anything is mounted over the host's paths:
# the workspace may itself be under /tmp, which gets a tmpfs below.
ws_path=$(sed -n 's/^export RIXL_WS=//p' "$H$job/job.sh" 2>/dev/null)
[ -n "$ws_path" ] || fail "cannot read job $job"
mount -t proc proc $H/proc
mount -t sysfs sys $H/sys
mount -t devtmpfs dev $H/dev
# POSIX shared memory (shm_open, /dev/shm files), as on any Linux host.
mkdir -p $H/dev/shm && mount -t tmpfs -o size=256m shm $H/dev/shm
mount -t tmpfs -o size=512m tmp $H/tmp
mount -t tmpfs run $H/run
# printf %q quoting in job.sh: undo the simple cases (no spaces in the path).
ws_path=$(echo "$ws_path" | sed "s/^'//; s/'$//")
mkdir -p "$H$ws_path" 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 ws "$H$ws_path" || fail "mount workspace at $ws_path"
[ -f "$H$job/job.sh" ] || fail "job not visible after mounting the workspace"

IP=/usr/bin/ip
RUN() { chroot $H "$@"; }
RUN $IP link set lo up
if [ -e /sys/class/net/eth0 ]; then
  # Two-guest mode: rxe on the emulated wire.
  addr=10.77.0.$((idx + 1)); peer=10.77.0.$((2 - idx))
  RUN $IP link set eth0 mtu 1500 up
  RUN $IP addr add $addr/24 dev eth0
  RUN /usr/bin/rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add (eth0)"
  guest_env="export RIXL_GUEST_ADDR=$addr RIXL_PEER_ADDR=$peer RIXL_GUEST_INDEX=$idx"
else
  RUN $IP link add d0 type dummy || fail "ip link add d0"
  RUN $IP link set d0 mtu 9000 up
  RUN $IP addr add 198.18.0.1/24 dev d0
  RUN /usr/bin/rdma link add rxe0 type rxe netdev d0 || fail "rdma link add (d0)"
  # A second rail for multi-rail tests (rxe1 on its own dummy link; each rail loops back).
  RUN $IP link add d1 type dummy || fail "ip link add d1"
  RUN $IP link set d1 mtu 9000 up
  RUN $IP addr add 198.18.1.1/24 dev d1
  RUN /usr/bin/rdma link add rxe1 type rxe netdev d1 || fail "rdma link add (d1)"
  guest_env="export RIXL_GUEST_ADDR=198.18.0.1 RIXL_GUEST_INDEX=0 RIXL_GUEST_RAILS=rxe0,rxe1"
fi
[ -e /sys/class/infiniband/rxe0 ] || fail "no rxe0"
say "rxe0 ready ($(cat /proc/uptime | cut -d' ' -f1)s since boot)"

cat >$H/tmp/rixl-job.sh <<EOF
set +e
. "$job/job.sh"
$guest_env
export RIXL_IN_GUEST=1 RIXL_RDMA_DEVICE=rxe0 RIXL_GID_INDEX=1
export HOME=/root PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ulimit -l unlimited 2>/dev/null
# A few 2 MiB huge pages, so registrations of huge-page memory are exercised too.
echo 8 > /proc/sys/vm/nr_hugepages 2>/dev/null || true
cd "\$RIXL_CWD" 2>/dev/null || cd "\$RIXL_WS"
"\${cmd[@]}"
EOF
chroot $H /bin/bash /tmp/rixl-job.sh
rc=$?
echo "$rc" >"$H$job/status"
echo "RIXL-GUEST-RESULT: exit $rc"
sync
umount "$H$ws_path" 2>/dev/null
poweroff -f
sleep 5
