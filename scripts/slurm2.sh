#!/usr/bin/env bash
# A real TWO-node Slurm (one slurmctld, slurmd "node1" and "node2", own munged) on this one machine,
# for the multi-node tests and CI. Everything lives under one folder ($SLURM2_DIR); each daemon runs
# in its own network namespace (ip netns) with its own hostname (UTS namespace) and /etc/hosts (mount
# namespace); nothing is added to the root namespace. Runs beside scripts/slurm.sh's single-node
# cluster (other node names, cluster name, folder, munge socket, ports, cgroup roots).
#
#   bash scripts/slurm2.sh up        install if missing, write the config, start what is not running
#                                    (a killed slurmd is restarted), wait until both nodes are usable;
#                                    idempotent. Last line: the `env` line below.
#   bash scripts/slurm2.sh down      cancel all jobs, stop slurmd/slurmctld/munged by pid, SIGKILL every
#                                    process left in the cluster's namespaces, delete the namespaces
#   bash scripts/slurm2.sh status    pids, namespaces, sinfo; exit 0 only if everything is up
#   bash scripts/slurm2.sh env       export line for clients: SLURM_CONF and $SLURM2_DIR/bin first on
#                                    PATH (wrappers for sbatch, scontrol, srun, ... that enter the
#                                    controller's network namespace; inside a job they run directly)
#   bash scripts/slurm2.sh kill-node NODE   kill -9 NODE's slurmd and every process of its jobs (a node
#                                    failure); `up` brings it back
#
# Must run as root (ip netns, nsenter, slurmd). Why each choice: ../shared/docs/slurm.md ("Two nodes
# on one machine"). In short: not `ip netns exec` (it remounts /sys and the
# cgroup v1 mounts vanish) but `nsenter --net` + `unshare --uts --mount`; proctrack/cgroup stays on
# because each `slurmd -N NODE` gets its own cgroup root slurm_NODE (so two two-node clusters cannot
# share one kernel: they would both use slurm_node1); jobs inherit the namespaces, so `hostname` is
# the node's name and node1/node2/slurm2ctl resolve inside jobs (gloo, c10d).
set -euo pipefail

DIR="${SLURM2_DIR:-/tmp/oom-supervisor-slurm2}"
CONF="$DIR/slurm.conf"
NS="${SLURM2_NS:-oomsv2}"                 # namespaces $NS-ctl, $NS-node1, $NS-node2
NET="${SLURM2_NET:-10.77.0}"              # /24 inside the namespaces only; ctl .1, nodeI .(10+I)
NNODES="${SLURM2_NODES:-2}"
CPUS="${SLURM2_CPUS:-4}"                  # per node (config_overrides: more than the box has)
GPUS="${SLURM2_GPUS:-2}"                  # fake GPUs per node
KILLWAIT="${SLURM2_KILLWAIT:-30}"         # same as scripts/slurm.sh and Slurm's default
SLURMD_TIMEOUT="${SLURM2_SLURMD_TIMEOUT:-30}"
CTL=slurm2ctl
BIN="$DIR/bin"
CLIENTS="sbatch scontrol squeue scancel sacct srun sinfo salloc sstat sattach"
NODES=(); for i in $(seq 1 "$NNODES"); do NODES+=("node$i"); done

say() { echo "slurm2.sh: $*" >&2; }
die() { say "$*"; exit 1; }
# A process that exited stays a zombie until PID 1 reaps it (1-2 s in this container), so
# "running" is read from /proc, not from kill -0.
running() { local st; st="$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null)" && [ "${st%% *}" != Z ]; }
alive() { [ -f "$1" ] && running "$(cat "$1" 2>/dev/null)"; }
envline() { echo "export SLURM_CONF=$CONF PATH=$BIN:\$PATH"; }

install_packages() {  # as scripts/slurm.sh
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && command -v ip >/dev/null && command -v nsenter >/dev/null && return 0
  say "installing slurmctld slurmd slurm-client munge iproute2 util-linux"
  local added=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then  # the packages' postinst would start services
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; added=1
  fi
  apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge iproute2 util-linux >/dev/null || die "apt-get install failed"
  [ -n "$added" ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

# ---------------------------------------------------------------- namespaces and network
ensure_ns() { [ -e "/run/netns/$1" ] || ip netns add "$1"; ip -n "$1" link set lo up; }

setup_net() {
  local i n
  if [ -e "/run/netns/$NS-ctl" ] && [ "$(cat "$DIR/netns.owner" 2>/dev/null)" != "$DIR" ]; then
    # Namespaces not made for this folder: stale ones (no process inside) go, live ones stop us.
    for n in ctl "${NODES[@]}"; do
      [ -z "$(ip netns pids "$NS-$n" 2>/dev/null)" ] \
        || die "namespace $NS-$n is in use by another cluster (not $DIR); set SLURM2_NS or run its down"
    done
    for n in ctl "${NODES[@]}"; do [ -e "/run/netns/$NS-$n" ] && ip netns del "$NS-$n"; done
  fi
  ensure_ns "$NS-ctl"
  echo "$DIR" > "$DIR/netns.owner"
  if ! ip -n "$NS-ctl" link show br0 >/dev/null 2>&1; then
    ip -n "$NS-ctl" link add br0 type bridge
    ip -n "$NS-ctl" addr add "$NET.1/24" dev br0
  fi
  ip -n "$NS-ctl" link set br0 up
  for i in $(seq 1 "$NNODES"); do
    n="node$i"; ensure_ns "$NS-$n"
    if ! ip -n "$NS-ctl" link show "v$n" >/dev/null 2>&1; then
      ip -n "$NS-$n" link del eth0 2>/dev/null || true
      ip -n "$NS-ctl" link add "v$n" type veth peer name eth0 netns "$NS-$n"
      ip -n "$NS-$n" addr add "$NET.$((10 + i))/24" dev eth0
    fi
    ip -n "$NS-ctl" link set "v$n" master br0 up
    ip -n "$NS-$n" link set eth0 up
  done
}

# Run "$@" in namespace $1 with hostname $2 and the cluster's /etc/hosts (own UTS + mount namespace;
# propagation slave so the bind mount stays inside). The daemons fork and keep these namespaces;
# their jobs inherit them.
in_ns() {
  local ns="$1" host="$2"; shift 2
  nsenter --net="/run/netns/$ns" -- unshare --uts --mount --propagation slave -- \
    sh -c 'hostname "$1"; mount --bind "$2" /etc/hosts; shift 2; exec "$@"' sh "$host" "$DIR/etc/hosts" "$@" 9>&-
}

# ---------------------------------------------------------------- config
write_config() {
  mkdir -p "$DIR"/{ctl/state,etc,munge} "$BIN"
  chmod 755 "$DIR"
  local mem i n
  for n in "${NODES[@]}"; do
    mkdir -p "$DIR/$n/spool" "$DIR/$n/dev"
    for i in $(seq 0 $((GPUS - 1))); do
      [ -c "$DIR/$n/dev/fakegpu$i" ] || mknod "$DIR/$n/dev/fakegpu$i" c 1 3
    done
  done
  mem="$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')"
  mem="${SLURM2_MEM_MB:-$((mem / NNODES))}"
  {
    printf '127.0.0.1 localhost\n%s.1 %s\n' "$NET" "$CTL"
    for i in $(seq 1 "$NNODES"); do printf '%s.%s node%s\n' "$NET" $((10 + i)) "$i"; done
  } > "$DIR/etc/hosts.tmp"
  mv "$DIR/etc/hosts.tmp" "$DIR/etc/hosts"
  cat > "$CONF.tmp" <<EOF
# written by scripts/slurm2.sh: two slurmd on one machine, one network namespace each
ClusterName=oomsup2
SlurmctldHost=$CTL($NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
SlurmctldPort=${SLURM2_CTLD_PORT:-6927}
SlurmdPort=${SLURM2_SLURMD_PORT:-6928}
StateSaveLocation=$DIR/ctl/state
SlurmctldLogFile=$DIR/ctl/slurmctld.log
SlurmctldPidFile=$DIR/ctl/slurmctld.pid
SlurmdSpoolDir=$DIR/%n/spool
SlurmdLogFile=$DIR/%n/slurmd.log
SlurmdPidFile=$DIR/%n/slurmd.pid
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
JobAcctGatherType=jobacct_gather/cgroup
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
GresTypes=gpu
MinJobAge=300
KillWait=$KILLWAIT
SlurmdTimeout=$SLURMD_TIMEOUT
ReturnToService=1
MailProg=/bin/true
MpiDefault=none
SlurmdParameters=config_overrides
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
EOF
  for i in $(seq 1 "$NNODES"); do
    echo "NodeName=node$i NodeHostname=node$i NodeAddr=$NET.$((10 + i)) CPUs=$CPUS RealMemory=$mem Gres=gpu:$GPUS State=UNKNOWN" >> "$CONF.tmp"
  done
  cat >> "$CONF.tmp" <<EOF
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=2
PartitionName=scavenger Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1
EOF
  if cmp -s "$CONF.tmp" "$CONF"; then rm -f "$CONF.tmp"; else mv "$CONF.tmp" "$CONF"; CHANGED=1; fi
  cat > "$DIR/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
ConstrainRAMSpace=yes
ConstrainSwapSpace=yes
AllowedSwapSpace=0
EOF
  : > "$DIR/gres.conf"
  for n in "${NODES[@]}"; do
    echo "NodeName=$n Name=gpu File=$DIR/$n/dev/fakegpu[0-$((GPUS - 1))]" >> "$DIR/gres.conf"
  done
  write_wrappers
}

write_wrappers() {
  local c real inos="" n
  for n in ctl "${NODES[@]}"; do inos="$inos /run/netns/$NS-$n"; done
  for c in $CLIENTS; do
    real="$(command -v "$c" 2>/dev/null)" || continue
    [ "$real" = "$BIN/$c" ] && real="/usr/bin/$c"
    cat > "$BIN/$c.tmp" <<EOF
#!/bin/sh
# scripts/slurm2.sh: $c for the two-node cluster. Outside the cluster it enters the controller's
# network namespace (needs root); inside a job (a node's namespace) it runs directly.
export SLURM_CONF=$CONF
self=\$(stat -L -c %i /proc/self/ns/net)
for f in$inos; do
  [ "\$self" = "\$(stat -L -c %i "\$f" 2>/dev/null)" ] && exec $real "\$@"
done
exec nsenter --net=/run/netns/$NS-ctl -- $real "\$@"
EOF
    chmod 755 "$BIN/$c.tmp"; mv "$BIN/$c.tmp" "$BIN/$c"
  done
}

# ---------------------------------------------------------------- daemons
start_munge() {
  alive "$DIR/munge/munged.pid" && [ -S "$DIR/munge/munge.socket.2" ] && return 0
  chown munge:munge "$DIR/munge"; chmod 700 "$DIR/munge"
  if [ ! -s "$DIR/munge/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$DIR/munge/munge.key"; chmod 400 "$DIR/munge/munge.key"
  fi
  runuser -u munge -- munged --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed" --force 9>&-
  for _ in $(seq 50); do alive "$DIR/munge/munged.pid" && [ -S "$DIR/munge/munge.socket.2" ] && return 0; sleep 0.1; done
  die "munged did not start: $(tail -3 "$DIR/munge/munged.log" 2>/dev/null)"
}

start_ctld() {
  alive "$DIR/ctl/slurmctld.pid" && return 0
  in_ns "$NS-ctl" "$CTL" slurmctld -f "$CONF" || die "slurmctld failed: $(tail -5 "$DIR/ctl/slurmctld.log")"
}

start_slurmd() {
  local n="$1"
  alive "$DIR/$n/slurmd.pid" && return 0
  # A node killed with kill -9 may leave job processes behind in its namespace: end them first.
  kill_ns_procs "$NS-$n"
  in_ns "$NS-$n" "$n" slurmd -f "$CONF" -N "$n" || die "slurmd $n failed: $(tail -5 "$DIR/$n/slurmd.log")"
}

sinfo_() { SLURM_CONF="$CONF" nsenter --net="/run/netns/$NS-ctl" -- sinfo "$@"; }
scontrol_() { SLURM_CONF="$CONF" nsenter --net="/run/netns/$NS-ctl" -- scontrol "$@"; }

nodes_usable() {  # every node idle/mixed/allocated/completing, without a "*" (not responding)
  local out n
  out="$(sinfo_ -h -N -o '%N %T' 2>/dev/null)" || return 1
  for n in "${NODES[@]}"; do
    echo "$out" | grep -Eq "^$n (idle|mixed|allocated|completing)$" || return 1
  done
}

up() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces, nsenter, slurmd)"
  install_packages
  [ -d /sys/fs/cgroup/memory ] || die "no cgroup v1 memory controller (this config is for cgroup v1)"
  mkdir -p "$DIR"
  exec 9>"$DIR/.lock"; flock 9
  CHANGED=""
  write_config
  if [ -n "$CHANGED" ] && { alive "$DIR/ctl/slurmctld.pid" || any_slurmd_alive; }; then
    say "config changed: restarting"; down_locked
  fi
  local n all=1
  for n in "${NODES[@]}"; do alive "$DIR/$n/slurmd.pid" || all=""; done
  if [ -n "$all" ] && alive "$DIR/ctl/slurmctld.pid" && alive "$DIR/munge/munged.pid" && nodes_usable; then
    envline; return 0
  fi
  setup_net
  start_munge
  start_ctld
  for n in "${NODES[@]}"; do start_slurmd "$n"; done
  for i in $(seq 150); do
    if nodes_usable; then envline; return 0; fi
    # A node left down/drained (by hand or by an earlier run) comes back when asked.
    if [ $((i % 10)) = 1 ]; then
      for n in "${NODES[@]}"; do
        sinfo_ -h -N -n "$n" -o '%T' 2>/dev/null | grep -Eq '^(down|drain|drained|draining|fail)' \
          && scontrol_ update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
      done
    fi
    sleep 0.2
  done
  sinfo_ -N -l >&2 || true
  die "nodes not usable after 30 s; logs in $DIR/ctl and $DIR/node*"
}

any_slurmd_alive() { local n; for n in "${NODES[@]}"; do alive "$DIR/$n/slurmd.pid" && return 0; done; return 1; }

stop_pids() {  # SIGTERM to every pid file's daemon at once, wait up to 10 s, then SIGKILL
  local f pids="" p
  for f in "$@"; do alive "$f" && pids="$pids $(cat "$f")"; done
  [ -n "$pids" ] || return 0
  kill $pids 2>/dev/null || true
  for _ in $(seq 100); do
    for p in $pids; do running "$p" && break; p=""; done
    [ -z "$p" ] && return 0
    sleep 0.1
  done
  for p in $pids; do running "$p" && say "pid $p ($(cat /proc/$p/comm 2>/dev/null)) ignored SIGTERM for 10 s: SIGKILL"; done
  kill -9 $pids 2>/dev/null || true
}

kill_ns_procs() {  # SIGKILL every process whose network namespace is $1, until none is left
  local ns="$1" pids
  [ -e "/run/netns/$ns" ] || return 0
  for _ in $(seq 50); do
    pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
    [ -n "${pids// /}" ] || return 0
    kill -9 $pids 2>/dev/null || true
    sleep 0.1
  done
  say "processes still in $ns: $pids"
}

rm_cgroups() {  # the empty job cgroups slurm_NODE/... that Slurm leaves behind (cgroup v1)
  local n c
  for n in "${NODES[@]}"; do
    for c in /sys/fs/cgroup/*/slurm_"$n"; do
      [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} + 2>/dev/null || true
    done
  done
}

down_locked() {
  local n
  if alive "$DIR/ctl/slurmctld.pid"; then
    # Cancel every job first, so that none is requeued and run again at the next `up`.
    local ids; ids="$(SLURM_CONF="$CONF" nsenter --net="/run/netns/$NS-ctl" -- squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)"
    [ -n "${ids// /}" ] && SLURM_CONF="$CONF" nsenter --net="/run/netns/$NS-ctl" -- scancel $ids 2>/dev/null || true
  fi
  # Daemons stop together (each takes 1-2 s alone); running jobs survive a stopped slurmd, so
  # their slurmstepd and processes are SIGKILLed by namespace afterwards.
  local files=("$DIR/ctl/slurmctld.pid" "$DIR/munge/munged.pid")
  for n in "${NODES[@]}"; do files+=("$DIR/$n/slurmd.pid"); done
  stop_pids "${files[@]}"
  for n in ctl "${NODES[@]}"; do kill_ns_procs "$NS-$n"; done
  rm_cgroups
  for n in ctl "${NODES[@]}"; do [ -e "/run/netns/$NS-$n" ] && ip netns del "$NS-$n"; done
  rm -f "$DIR/netns.owner"
  return 0
}

down() { [ -d "$DIR" ] || return 0; exec 9>"$DIR/.lock"; flock 9; down_locked; }

status() {
  local ok=0 n f
  for f in munge/munged ctl/slurmctld; do
    if alive "$DIR/$f.pid"; then echo "$f: pid $(cat "$DIR/$f.pid")"; else echo "$f: not running"; ok=1; fi
  done
  for n in "${NODES[@]}"; do
    if alive "$DIR/$n/slurmd.pid"; then echo "$n/slurmd: pid $(cat "$DIR/$n/slurmd.pid")"; else echo "$n/slurmd: not running"; ok=1; fi
  done
  for n in ctl "${NODES[@]}"; do
    if [ -e "/run/netns/$NS-$n" ]; then echo "netns $NS-$n: $(ip netns pids "$NS-$n" 2>/dev/null | wc -l) processes"; else echo "netns $NS-$n: absent"; ok=1; fi
  done
  if [ -e "/run/netns/$NS-ctl" ] && alive "$DIR/ctl/slurmctld.pid"; then sinfo_ -N -o '%N %T %c %m %G %E' || ok=1; fi
  nodes_usable || ok=1
  return $ok
}

kill_node() {
  local n="${1:-}"
  [ -n "$n" ] && [ -e "/run/netns/$NS-$n" ] || die "usage: $0 kill-node node1|node2 (namespace $NS-$n absent)"
  kill_ns_procs "$NS-$n"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  env) envline ;;
  kill-node) kill_node "${2:-}" ;;
  *) echo "usage: $0 up|down|status|env|kill-node NODE" >&2; exit 2 ;;
esac
