#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying `--launcher slurm` and for the tests.
#
#     sudo bash scripts/slurm_local.sh        # idempotent: installs, configures and starts what is missing
#
# Installs Debian's slurm-wlm and munge with apt, writes /etc/slurm/slurm.conf for one node (this host)
# with one partition "debug", and starts munged, slurmctld and slurmd without systemd. The node claims
# AIAYN_SLURM_CPUS CPUs (default 8, more than a small machine has, so that a 2-trial sweep and a 2-task
# run fit at once; slurmd accepts it because of SlurmdParameters=config_overrides).
# SLURM 22.05 (Debian 12): ProctrackType=proctrack/linuxproc and TaskPlugin=task/none need no cgroup.conf;
# 22.05 rejects CgroupPlugin=disabled, so there is none. Jobs run as root (SlurmUser=root).
# A requeued job waits cred_expire seconds before it may start again (120 by default) and then for the
# next scheduling pass (sched_interval, 60 by default): 15 and 2 here, so that a preempted job resumes
# within seconds, not minutes. cred_expire is also how long a job step's credential lasts, ample on one node.
set -euo pipefail

cpus="${AIAYN_SLURM_CPUS:-8}"
host="$(hostname -s)"
conf=/etc/slurm/slurm.conf

if [ "$(id -u)" != 0 ]; then
  echo "slurm_local.sh: run as root (it installs packages and starts daemons)" >&2
  exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  echo "[slurm] installing slurm-wlm and munge with apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

# ---- munge: a key, its run directory, the daemon --------------------------------------------------------
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  echo "[slurm] starting munged"
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# ---- slurm.conf -------------------------------------------------------------------------------------------
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
wanted="$(cat <<CONF
# Written by aiayn scripts/slurm_local.sh: a one-node cluster on $host.
ClusterName=aiayn
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=15
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=30
MinJobAge=300
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
)"
restart=0
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$wanted" ]; then
  echo "$wanted" > "$conf"
  restart=1
fi

# ---- daemons ------------------------------------------------------------------------------------------------
running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$restart" = 1 ]; then
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    if running "$pidfile"; then kill "$(cat "$pidfile")"; sleep 1; fi
  done
fi
if ! running /run/slurmctld.pid; then
  echo "[slurm] starting slurmctld"
  slurmctld
fi
if ! running /run/slurmd.pid; then
  echo "[slurm] starting slurmd"
  slurmd
fi

for _ in $(seq 60); do
  state="$(sinfo -h -n "$host" -o %T 2>/dev/null || true)"
  case "$state" in
    idle*|mixed*|allocated*) break ;;
    down*|drain*) scontrol update NodeName="$host" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 1
done
state="$(sinfo -h -n "$host" -o %T 2>/dev/null || true)"
case "$state" in
  idle*|mixed*|allocated*) echo "[slurm] up: node $host ($state), partition debug, $cpus CPUs" ;;
  *) echo "[slurm] node $host is '${state:-unreachable}'; see /var/log/slurm/slurmctld.log and slurmd.log" >&2
     exit 1 ;;
esac
