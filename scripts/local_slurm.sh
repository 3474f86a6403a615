#!/usr/bin/env bash
# scripts/local_slurm.sh start|stop|status — a real one-node SLURM cluster on this machine, to run lmlab's SLURM
# sweeps (hydra/launcher=slurm) and its `slurm` tests without a cluster. Debian/Ubuntu, as root; no systemd needed.
#
# start   installs slurmctld, slurmd, slurm-client and munge if missing (apt-get), writes /etc/slurm/slurm.conf
#         (marked as ours; a config it did not write is refused, never overwritten), starts munged, slurmctld and
#         slurmd as plain daemons, waits for an idle node and runs one `srun true`. Idempotent: with the daemons up it
#         only checks them. Each daemon it starts is recorded (pid + binary) under $LOCAL_SLURM_RUN.
# stop    cancels the jobs still queued (their slurmstepd would outlive slurmd), then stops exactly the recorded
#         daemons, by pid, and only while that pid still runs the recorded binary. Packages, config, state stay.
# status  what runs, what is ours, and sinfo.
#
# Why the settings (measured: ../shared/docs/SLURM-LOCAL.md in the lab's notes):
#   AuthInfo=cred_expire=10   a requeued job may start again after cred_expire + 1 s (SLURM's default 120 s)
#   sched_interval/bf_interval=5, EnforcePartLimits=ALL (a request no node meets fails at sbatch instead of pending
#   forever), MailProg=/bin/true (no mail binary), JobRequeue=1, proctrack/linuxproc + task/none (no cgroups).
#
# Knobs: LOCAL_SLURM_CPUS (default: the CPUs this process may use), LOCAL_SLURM_MEM_MB (default 85% of MemTotal),
# LOCAL_SLURM_PARTITION (default debug), LOCAL_SLURM_REQUEUE_DELAY (cred_expire, default 10), LOCAL_SLURM_RUN (default /run/lmlab-slurm).
# LOCAL_SLURM_TWO_NODES=1 adds a second node, n2: a slurmd in a network namespace of its own (and a UTS namespace,
# so its hostname is n2) joined to this one by a veth pair `lmlabv` on 10.213.7.0/24, which start creates and stop
# removes; this host is 10.213.7.1, n2 10.213.7.2. The default partition stays this host alone; partition `two`
# holds both, for multi-node jobs (trainer.num_nodes=2 hydra.launcher.partition=two; ranks reach each other with
# GLOO_SOCKET_IFNAME=lmlabv and MASTER_ADDR=10.213.7.2, n2 being the first node of the job's node list).
# Exit codes: 0 up / stopped; 1 a daemon did not come up (its log's tail is printed); 2 refused (not root, a foreign
# config, a controller that is not ours already answering, bad usage); 3 (status) not up.
set -euo pipefail

MARK="# written by lmlab scripts/local_slurm.sh"
CONF=/etc/slurm/slurm.conf
RUN=${LOCAL_SLURM_RUN:-/run/lmlab-slurm}
LOG=/var/log/slurm
HOST=$(hostname -s)
TWO=${LOCAL_SLURM_TWO_NODES:-0}
NS=lmlab-n2 VETH=lmlabv NET=10.213.7
T0=$(date +%s.%N)

say() { echo "local_slurm: $*"; }
die() { local code=$1; shift; echo "local_slurm: error: $*" >&2; exit "$code"; }
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}'; }
tail_log() { [ -f "$1" ] && { echo "--- last lines of $1:" >&2; tail -n 15 "$1" >&2; }; return 0; }

# wait_for SECONDS CMD...: run CMD every half second until it succeeds
wait_for() {
  local deadline=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.5
  done
}

# alive NAME: prints the recorded pid of NAME if that pid still runs the recorded binary (a reused pid does not)
alive() {
  local pid exe
  [ -f "$RUN/$1.pid" ] || return 1
  read -r pid exe < "$RUN/$1.pid" || return 1
  [ -n "$pid" ] && [ "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" = "$exe" ] && echo "$pid"
}

# record NAME PIDFILE: this script started NAME (its pid and binary, for stop)
record() {
  local pid; pid=$(cat "$2")
  echo "$pid $(readlink -f "/proc/$pid/exe")" > "$RUN/$1.pid"
  say "started $1 (pid $pid)"
}

# clear_pidfile NAME PIDFILE: drop a stale pid file before starting NAME; refuse if that pid runs NAME (not ours)
clear_pidfile() {
  local pid; pid=$(cat "$2" 2>/dev/null || true)
  if [ -n "$pid" ] && [[ "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" == */$1* ]]; then
    die 2 "a $1 that this script did not start runs already (pid $pid, $2); stop it first"
  fi
  rm -f "$2"
}

render_conf() {
  # nproc honours OMP_NUM_THREADS (CI exports 1): the CPUs the process may use, without it
  local cpus=${LOCAL_SLURM_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)} partition=${LOCAL_SLURM_PARTITION:-debug}
  local mem=${LOCAL_SLURM_MEM_MB:-$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.85}' /proc/meminfo)}
  cat <<EOF
$MARK: edit its knobs (LOCAL_SLURM_*), not this file
ClusterName=lmlab
SlurmctldHost=$( [ "$TWO" = 1 ] && echo "$HOST($NET.1)" || echo localhost)
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again cred_expire + 1 s after it stopped (SLURM's default: 120 s)
AuthInfo=cred_expire=${LOCAL_SLURM_REQUEUE_DELAY:-10}
MpiDefault=none
# no cgroups: they may not be writable in a container
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
ReturnToService=2
JobRequeue=1
# a request no node can meet fails at sbatch instead of pending forever (Reason=PartitionConfig)
EnforcePartLimits=ALL
KillWait=30
MinJobAge=600
MailProg=/bin/true
StateSaveLocation=/var/spool/slurmctld
# one spool, pid file and log per node (%n): LOCAL_SLURM_TWO_NODES=1 runs two slurmd on this host
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no slurmdbd: sacct answers 'Slurm accounting storage is disabled' (lmlab's launcher does not need it)
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
EOF
  if [ "$TWO" = 1 ]; then
    local half=$(( mem / 2 ))
    echo "NodeName=$HOST NodeAddr=$NET.1 CPUs=$cpus RealMemory=$half State=UNKNOWN"
    echo "NodeName=n2 NodeAddr=$NET.2 NodeHostname=n2 CPUs=$cpus RealMemory=$half State=UNKNOWN"
    echo "PartitionName=$partition Nodes=$HOST Default=YES MaxTime=INFINITE State=UP"
    echo "PartitionName=two Nodes=$HOST,n2 MaxTime=INFINITE State=UP"
  else
    echo "NodeName=$HOST CPUs=$cpus RealMemory=$mem State=UNKNOWN"
    echo "PartitionName=$partition Nodes=$HOST Default=YES MaxTime=INFINITE State=UP"
  fi
}

install_packages() {
  local need=() c
  for c in munged slurmctld slurmd sbatch srun scontrol sinfo scancel; do command -v "$c" >/dev/null || need+=("$c"); done
  [ ${#need[@]} -eq 0 ] && return 0
  say "installing slurmctld slurmd slurm-client munge (missing: ${need[*]})"
  export DEBIAN_FRONTEND=noninteractive
  local pkgs=(slurmctld slurmd slurm-client munge)
  apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null
  }
  say "installed ($(elapsed) s)"
}

prepare_dirs() {
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
  fi
  chown munge:munge /etc/munge /etc/munge/munge.key && chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
  mkdir -p "$RUN" /run/munge /run/slurm /var/spool/slurmctld /var/spool/slurmd/"$HOST" /var/spool/slurmd/n2 "$LOG" \
    /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge && chmod 755 /run/munge
  chown slurm:slurm /run/slurm /var/spool/slurmctld "$LOG"
}

write_conf() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die 2 "$CONF exists and was not written by this script: refusing to overwrite it (move it away to use this script)"
  fi
  mkdir -p /etc/slurm
  if ! cmp -s <(render_conf) "$CONF" 2>/dev/null; then
    if alive slurmctld >/dev/null || alive slurmd >/dev/null; then
      say "warning: the running daemons use an older $CONF; '$0 stop' then 'start' applies the new one"
    else
      render_conf > "$CONF.tmp" && mv "$CONF.tmp" "$CONF"
      say "wrote $CONF"
    fi
  fi
  getent hosts "$HOST" >/dev/null || say "warning: '$HOST' does not resolve; DDP jobs (MASTER_ADDR) need it in /etc/hosts"
}

munge_ok() { munge -n </dev/null | unmunge >/dev/null; }
ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
node_state() { sinfo -h -N -n "$HOST" -o %T 2>/dev/null | head -n 1; }
node_ready() { case "$(node_state)" in idle*|mixed*|allocated*|completing*) return 0;; *) return 1;; esac; }

# the second node's network: a namespace and a veth pair (recorded: stop removes what start made)
make_second_network() {
  if [ ! -e "/run/netns/$NS" ]; then
    ip netns add "$NS" && echo "$NS" > "$RUN/netns"
    ip link add "$VETH" type veth peer name "${VETH}p"
    ip link set "${VETH}p" netns "$NS"
    ip netns exec "$NS" ip link set "${VETH}p" name "$VETH"  # the same name at both ends: one GLOO_SOCKET_IFNAME
    ip addr add "$NET.1/24" dev "$VETH" && ip link set "$VETH" up
    ip netns exec "$NS" sh -c "ip addr add $NET.2/24 dev $VETH && ip link set $VETH up && ip link set lo up"
    say "made network namespace $NS, veth $VETH: $NET.1 here, $NET.2 in $NS"
  fi
}

# the second node's slurmd, in that network namespace and a UTS namespace of its own (hostname n2)
start_second_node() {
  if alive slurmd-n2 >/dev/null; then say "slurmd of n2 up (ours)"; return 0; fi
  rm -f "$RUN/slurmd-n2.pid"; clear_pidfile slurmd /run/slurm/slurmd-n2.pid
  # nsenter, not `ip netns exec`: that one mounts a sysfs of its own, without /sys/fs/cgroup, and slurmd then stops
  nsenter --net="/run/netns/$NS" unshare --uts sh -c 'hostname n2 && exec /usr/sbin/slurmd' \
    || { tail_log "$LOG/slurmd-n2.log"; die 1 "the slurmd of n2 did not start"; }
  wait_for 10 test -s /run/slurm/slurmd-n2.pid || { tail_log "$LOG/slurmd-n2.log"; die 1 "n2's slurmd wrote no pid file"; }
  record slurmd-n2 /run/slurm/slurmd-n2.pid
  wait_for 30 sh -c '[ "$(sinfo -h -N -n n2 -o %T)" = idle ]' || { tail_log "$LOG/slurmd-n2.log"; die 1 "node n2 is not idle"; }
}

start() {
  [ "$(id -u)" = 0 ] || die 2 "run as root (it installs packages and starts daemons)"
  install_packages
  prepare_dirs
  write_conf

  if munge_ok 2>/dev/null; then
    alive munged >/dev/null && say "munged up (ours)" || say "munged up (not started here: left alone)"
  else
    rm -f "$RUN/munged.pid"; clear_pidfile munged /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged || { tail_log /var/log/munge/munged.log; die 1 "munged did not start"; }
    wait_for 10 test -s /run/munge/munged.pid || die 1 "munged wrote no pid file"
    record munged /run/munge/munged.pid
    wait_for 10 munge_ok || { tail_log /var/log/munge/munged.log; die 1 "munged started but does not answer"; }
  fi
  [ "$TWO" = 1 ] && make_second_network  # before slurmctld, which listens on 10.213.7.1 then

  if alive slurmctld >/dev/null && ctld_up; then
    say "slurmctld up (ours)"
  elif ctld_up; then
    die 2 "a slurmctld that this script did not start already answers (scontrol ping); stop it first"
  else
    rm -f "$RUN/slurmctld.pid"; clear_pidfile slurmctld /run/slurm/slurmctld.pid
    /usr/sbin/slurmctld || { tail_log "$LOG/slurmctld.log"; die 1 "slurmctld did not start"; }
    wait_for 10 test -s /run/slurm/slurmctld.pid || { tail_log "$LOG/slurmctld.log"; die 1 "slurmctld wrote no pid file"; }
    record slurmctld /run/slurm/slurmctld.pid  # before the wait: a controller that never answers is still stopped
    wait_for 30 ctld_up || { tail_log "$LOG/slurmctld.log"; die 1 "slurmctld started but scontrol ping does not see it"; }
  fi

  if alive slurmd >/dev/null; then
    say "slurmd up (ours)"
  else
    rm -f "$RUN/slurmd.pid"; clear_pidfile slurmd "/run/slurm/slurmd-$HOST.pid"
    /usr/sbin/slurmd || { tail_log "$LOG/slurmd-$HOST.log"; die 1 "slurmd did not start"; }
    wait_for 10 test -s "/run/slurm/slurmd-$HOST.pid" || { tail_log "$LOG/slurmd-$HOST.log"; die 1 "slurmd wrote no pid file"; }
    record slurmd "/run/slurm/slurmd-$HOST.pid"
  fi
  [ "$TWO" = 1 ] && start_second_node
  if ! wait_for 20 node_ready; then  # a node an earlier run left down: the daemons are new, so resume it
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
    wait_for 20 node_ready || { tail_log "$LOG/slurmd-$HOST.log"; die 1 "node $HOST is '$(node_state)', not idle"; }
  fi
  timeout 60 srun -N1 -n1 -t 1 true || { tail_log "$LOG/slurmd-$HOST.log"; die 1 "srun true failed"; }
  if [ "$TWO" = 1 ]; then
    timeout 60 srun -p two -N2 -n2 -t 1 true || { tail_log "$LOG/slurmd-n2.log"; die 1 "srun over both nodes failed"; }
  fi
  say "up in $(elapsed) s: $(sinfo -h -o '%P %a %D node(s) %T %N %c CPUs %m MB' | head -n 1)"
  say "try: python train.py -m placement=pre,post trainer.accelerator=cpu hydra/launcher=slurm" \
      "  (stop: $0 stop)"
}

stop() {
  [ "$(id -u)" = 0 ] || die 2 "run as root"
  ls "$RUN"/*.pid >/dev/null 2>&1 || { say "nothing recorded in $RUN: nothing to stop"; return 0; }
  if alive slurmctld >/dev/null; then
    local jobs left
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// }" ]; then
      say "cancelling the jobs still queued: $jobs"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      wait_for 45 sh -c '[ -z "$(squeue -h -o %i)" ]' || true  # KillWait (30 s) and the epilog
      left=$(squeue -h -o '%i %T' 2>/dev/null | tr '\n' ' ')
      [ -z "${left// }" ] || say "warning: still in the queue: $left"
    fi
  fi
  local status=0 name pid
  for name in slurmd-n2 slurmd slurmctld munged; do
    [ -f "$RUN/$name.pid" ] || continue
    if ! pid=$(alive "$name"); then
      say "$name: its recorded pid $(cut -d' ' -f1 "$RUN/$name.pid") no longer runs it (already stopped)"
      rm -f "$RUN/$name.pid"; continue
    fi
    kill -TERM "$pid"
    wait_for 30 sh -c "[ ! -e /proc/$pid ]" || { say "$name (pid $pid) still up after 30 s: SIGKILL"; kill -KILL "$pid"; sleep 1; }
    if [ -e "/proc/$pid" ]; then say "error: $name (pid $pid) did not stop"; status=1
    else say "stopped $name (pid $pid)"; rm -f "$RUN/$name.pid"; fi
  done
  if [ -f "$RUN/netns" ]; then  # the namespace and veth pair start made (deleting the namespace removes both ends)
    ip netns del "$(cat "$RUN/netns")" && say "removed network namespace $(cat "$RUN/netns") and its veth pair" \
      && rm -f "$RUN/netns"
  fi
  return $status
}

status() {
  local name pid up=0
  for name in munged slurmctld slurmd slurmd-n2; do
    if pid=$(alive "$name"); then say "$name: running, ours (pid $pid)"
    elif pgrep -x "$name" >/dev/null 2>&1; then say "$name: running, not started by this script"
    else say "$name: not running"; fi
  done
  if ctld_up; then say "controller: $(scontrol ping 2>/dev/null | head -n 1)"; sinfo 2>/dev/null || true
  else say "controller: no answer to scontrol ping"; up=3; fi
  return $up
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
