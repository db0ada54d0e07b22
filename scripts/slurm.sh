#!/usr/bin/env bash
# A real single-node Slurm (slurmctld + slurmd + munge, Debian packages) for the tests and CI,
# started by hand without systemd, everything under one folder ($SLURM_DIR).
#
#   bash scripts/slurm.sh up     install if missing, write the config, start, wait for the node
#                                to be idle; idempotent. Last line: SLURM_CONF=<path>
#   bash scripts/slurm.sh down   stop slurmd, slurmctld, munged (by their pid files)
#   bash scripts/slurm.sh env    print the export line for clients
#
# Why each choice: ../shared/docs/slurm.md (measured on these machines). Two fake GPUs are
# character devices (a gres with only Count= drains the node). SlurmdParameters=config_overrides
# lets the node declare more CPUs than the box has, so several short test jobs run at once.
# Partition "scavenger" (lower PriorityTier, PreemptMode=CANCEL) lets a test see PREEMPTED.
set -euo pipefail

DIR="${SLURM_DIR:-/tmp/oom-supervisor-slurm}"
CONF="$DIR/slurm.conf"
HOST="$(hostname -s)"
CPUS="${SLURM_TEST_CPUS:-8}"
GPUS="${SLURM_TEST_GPUS:-2}"
export SLURM_CONF="$CONF"

say() { echo "slurm.sh: $*" >&2; }
die() { say "$*"; exit 1; }

sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else return 1; fi; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && return 0
  say "installing slurmctld slurmd slurm-client munge"
  # The packages' postinst would start services; policy-rc.d exit 101 stops that.
  local added=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | sudo_ tee /usr/sbin/policy-rc.d >/dev/null
    sudo_ chmod +x /usr/sbin/policy-rc.d; added=1
  fi
  sudo_ apt-get update -qq || die "apt-get update failed (no root/sudo or no network)"
  sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null || die "apt-get install failed"
  [ -n "$added" ] && sudo_ rm -f /usr/sbin/policy-rc.d
  return 0
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

node_idle() {
  local st
  st="$(sinfo -h -N -n "$HOST" -o '%T' 2>/dev/null | head -1)" || return 1
  case "$st" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

write_config() {
  mkdir -p "$DIR"/{state,spool,log,dev,munge}
  chmod 755 "$DIR"
  for i in $(seq 0 $((GPUS - 1))); do
    [ -c "$DIR/dev/fakegpu$i" ] || mknod "$DIR/dev/fakegpu$i" c 1 3
  done
  local mem
  mem="$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')"
  cat > "$CONF.tmp" <<EOF
ClusterName=oomsup
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
SlurmctldPort=${SLURM_TEST_CTLD_PORT:-6917}
SlurmdPort=${SLURM_TEST_SLURMD_PORT:-6918}
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
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
KillWait=30
ReturnToService=2
MailProg=/bin/true
MpiDefault=none
SlurmdParameters=config_overrides
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem Gres=gpu:$GPUS State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
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
  echo "Name=gpu File=$DIR/dev/fakegpu[0-$((GPUS - 1))]" > "$DIR/gres.conf"
}

start_munge() {
  alive "$DIR/munge/munged.pid" && return 0
  chown munge:munge "$DIR/munge"; chmod 700 "$DIR/munge"
  if [ ! -s "$DIR/munge/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$DIR/munge/munge.key"; chmod 400 "$DIR/munge/munge.key"
  fi
  runuser -u munge -- munged --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed" --force
  for _ in $(seq 50); do alive "$DIR/munge/munged.pid" && [ -S "$DIR/munge/munge.socket.2" ] && return 0; sleep 0.1; done
  die "munged did not start: $(tail -3 "$DIR/munge/munged.log" 2>/dev/null)"
}

up() {
  [ "$(id -u)" = 0 ] || command -v sudo >/dev/null || die "needs root (slurmd runs as root)"
  install_packages
  [ -d /sys/fs/cgroup/memory ] || die "no cgroup v1 memory controller (Slurm here is configured for v1)"
  CHANGED=""
  write_config
  # A config written by an older version of this script: restart on the new one.
  if [ -n "$CHANGED" ] && { alive "$DIR/slurmctld.pid" || alive "$DIR/slurmd.pid"; }; then
    say "config changed: restarting"; down
  fi
  if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" && alive "$DIR/munge/munged.pid" && node_idle; then
    echo "SLURM_CONF=$CONF"; return 0
  fi
  start_munge
  alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF" || die "slurmctld failed: $(tail -5 "$DIR/log/slurmctld.log")"
  alive "$DIR/slurmd.pid" || slurmd -f "$CONF" || die "slurmd failed: $(tail -5 "$DIR/log/slurmd.log")"
  for i in $(seq 150); do
    if node_idle; then echo "SLURM_CONF=$CONF"; return 0; fi
    # A node left drained/down by an earlier run comes back when asked.
    [ $((i % 20)) = 0 ] && scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
    sleep 0.2
  done
  sinfo -N -l >&2 || true
  die "node $HOST not idle after 30 s; logs in $DIR/log"
}

stop_pid() {
  local f="$1" pid
  alive "$f" || return 0
  pid="$(cat "$f")"; kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

down() {
  stop_pid "$DIR/slurmd.pid"
  stop_pid "$DIR/slurmctld.pid"
  stop_pid "$DIR/munge/munged.pid"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
