#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the tests of scripts/slurm_gpu.sbatch (docs/slurm.md).
#
#   dir=$(bash scripts/slurm_local.sh up)        # prints the cluster's directory; SLURM_CONF=$dir/slurm.conf
#   SLURM_CONF=$dir/slurm.conf sbatch ...         # any SLURM command, pointed at this cluster
#   bash scripts/slurm_local.sh down "$dir"       # stops it: its jobs, then the daemons it started
#
# `up` (as root) installs Debian's slurmctld, slurmd, slurm-client and munge with apt-get when they are
# missing, writes a munge key and a slurm.conf into a new temporary directory (or $SLURM_LOCAL_DIR),
# starts munged, slurmctld and slurmd there in the foreground of their own sessions (so the pid this
# script records is the daemon's own), and returns once `sinfo` shows the node idle. Apart from the
# packages, nothing outside that directory is written: the daemons' sockets, logs, pid files, state and
# spool are in it, the ports are free ones picked now, and /etc/slurm and /etc/munge are not read. (On a
# machine run by systemd, installing the packages may also start Debian's own munge service; it is not
# one of ours and is left alone.)
# `down DIR` cancels the cluster's jobs (bounded wait), then stops exactly the pids `up` recorded in
# DIR/pids (SIGTERM, then SIGKILL after a bounded wait), each only if it is still the daemon it started,
# and removes DIR (SLURM_LOCAL_KEEP=1 keeps it, with the daemons' logs).
#
# The node: this machine's host name and CPUs = max(nproc, SLURM_LOCAL_CPUS or 3) (the tests' largest job,
# 3 tasks, fits a 2-core machine; its tasks then share the cores). No GPUs, no cgroups (processes are
# tracked by their parent pids), no accounting database.
#
# Exit status 3 with one line on stderr: this machine cannot run it (not root, no apt-get).
set -euo pipefail

die() { echo "slurm_local: $*" >&2; exit 1; }
cannot() { echo "slurm_local: $*" >&2; exit 3; }
WAIT_S="${SLURM_LOCAL_WAIT_S:-60}"  # each bounded wait (node idle, jobs gone, daemons gone)

install_packages() {
  local missing=()
  for tool in slurmctld slurmd sinfo munged; do
    command -v "$tool" >/dev/null || PATH="$PATH:/usr/sbin" command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null ||
    cannot "SLURM is not installed (${missing[*]} missing) and there is no apt-get to install it"
  echo "slurm_local: installing slurmctld slurmd slurm-client munge (about a minute) ..." >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >&2
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Starts "$@" in its own session, output to $dir/<name>.log, and records "<name> <pid>" in $dir/pids.
start() {
  local name="$1"; shift
  setsid "$@" >"$dir/$name.log" 2>&1 </dev/null &
  echo "$name $!" >>"$dir/pids"
}

up() {
  [ "$(id -u)" = 0 ] || cannot "needs root (to install and start munged, slurmctld and slurmd); running as $(id -un)"
  install_packages
  export PATH="$PATH:/usr/sbin"
  dir="${SLURM_LOCAL_DIR:-$(mktemp -d /tmp/slurm_local.XXXXXX)}"
  mkdir -p "$dir/state" "$dir/spool"
  chmod 755 "$dir"
  touch "$dir/pids"
  trap 'down "$dir" >&2 || true' EXIT  # a failure below stops what was started
  local host cpus ctld_port node_port
  host="$(hostname -s)"
  cpus="$(nproc)"
  [ "$cpus" -ge "${SLURM_LOCAL_CPUS:-3}" ] || cpus="${SLURM_LOCAL_CPUS:-3}"
  ctld_port="$(free_port)"
  node_port="$(free_port)"
  [ "$ctld_port" != "$node_port" ] || node_port="$(free_port)"

  # munge: its own key, socket, pid and seed files here; as root, so --force (munged prefers its own user).
  dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
  chmod 400 "$dir/munge.key"
  start munged munged --foreground --force --key-file="$dir/munge.key" --socket="$dir/munge.socket" \
    --pid-file="$dir/munged.pid" --seed-file="$dir/munged.seed" --log-file="$dir/munged.log.internal"

  cat >"$dir/slurm.conf" <<EOF
# Written by scripts/slurm_local.sh: a one-node cluster for tests.
ClusterName=local
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${ctld_port}
SlurmdPort=${node_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${dir}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd.pid
SlurmctldLogFile=${dir}/slurmctld.log.internal
SlurmdLogFile=${dir}/slurmd.log.internal
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF="$dir/slurm.conf"

  local deadline=$((SECONDS + WAIT_S))
  until [ -S "$dir/munge.socket" ]; do
    [ $SECONDS -lt $deadline ] || die "munged did not start within ${WAIT_S} s: $(tail -3 "$dir/munged.log")"
    sleep 0.2
  done
  start slurmctld slurmctld -D -i -f "$dir/slurm.conf"
  start slurmd slurmd -D -f "$dir/slurm.conf"
  until [ "$(sinfo --noheader --nodes="$host" --format=%T 2>/dev/null)" = idle ]; do
    if [ $SECONDS -ge $deadline ]; then
      echo "slurm_local: the node is not idle after ${WAIT_S} s (sinfo: $(sinfo --noheader 2>&1 | head -2))" >&2
      tail -n 5 "$dir"/slurmctld.log.internal "$dir"/slurmd.log.internal >&2 || true
      exit 1
    fi
    sleep 0.5
  done
  trap - EXIT
  echo "$dir"
}

# Whether pid $2 is still the process `up` started as $1 (not a recycled pid).
is_ours() {
  [ -r "/proc/$2/cmdline" ] && tr '\0' ' ' <"/proc/$2/cmdline" | grep -q "^$1 "
}

down() {
  dir="$1"
  [ -f "$dir/pids" ] || die "$dir/pids not found: not a directory that 'up' made"
  export PATH="$PATH:/usr/sbin" SLURM_CONF="$dir/slurm.conf"
  local deadline=$((SECONDS + WAIT_S))
  # Jobs first: their steps run under slurmstepd, which outlives slurmd.
  local jobs
  jobs="$(squeue --noheader --format=%i 2>/dev/null || true)"
  if [ -n "$jobs" ]; then
    scancel --full $jobs 2>/dev/null || true
    while [ -n "$(squeue --noheader --format=%i 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
  fi
  local name pid
  for name in slurmd slurmctld munged; do  # the reverse of their start
    pid="$(awk -v n="$name" '$1 == n {print $2}' "$dir/pids")"
    [ -n "$pid" ] && is_ours "$name" "$pid" || continue
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + WAIT_S))
    while is_ours "$name" "$pid" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    if is_ours "$name" "$pid"; then
      echo "slurm_local: $name (pid $pid) still running after ${WAIT_S} s: SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  [ "${SLURM_LOCAL_KEEP:-0}" = 1 ] || rm -rf "$dir"
}

case "${1:-}" in
  up) up ;;
  down) [ -n "${2:-}" ] || die "usage: $0 down DIR (the directory 'up' printed)"; down "$2" ;;
  *) die "usage: $0 up | down DIR" ;;
esac
