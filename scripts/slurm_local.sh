#!/usr/bin/env bash
# Start (or stop) a real one-node Slurm cluster on this machine, for tests
# that need `srun -n N ...` to launch N processes for real.
#
#   scripts/slurm_local.sh [start]   install slurm if missing (root + apt only),
#                                  write the config, start the daemons if they
#                                  are not running, wait until the node is idle
#   scripts/slurm_local.sh stop      stop the daemons started by this script
#   scripts/slurm_local.sh status    exit 0 if the node is usable, 1 otherwise
#   scripts/slurm_local.sh env       print the `export SLURM_CONF=...` line
#
# After `start`, run srun with SLURM_CONF pointing at the generated config:
#   export SLURM_CONF=/tmp/jax_smddp_slurm/slurm.conf   # or: eval "$(scripts/slurm_local.sh env)"
#   srun -n 2 python -c 'import os; print(os.environ["SLURM_PROCID"])'
# (If /etc/slurm/slurm.conf did not exist, `start` also links it to the
# generated config, so plain `srun` works without SLURM_CONF; `stop` removes
# that link again.)
#
# Design: one node named `hostname -s` at 127.0.0.1 that claims
# $SLURM_LOCAL_CPUS CPUs (default 8, whatever the hardware has; accepted via
# SlurmdParameters=config_overrides), so `srun -n 8` fits on a 2-core machine.
# No cgroups and no systemd: proctrack/linuxproc, task/none,
# jobacct_gather/none. Authentication is auth/none when the installed Slurm has
# that plugin (Debian 12's 22.05 does), else munge with a private key, socket
# and pid file under the state dir. Daemons run as root. State starts afresh on
# every start (old job/node state is deleted), so a node left DOWN by an earlier
# run cannot block the next one.
#
# Environment knobs:
#   SLURM_LOCAL_DIR    state/config/log dir     (default /tmp/jax_smddp_slurm)
#   SLURM_LOCAL_CPUS   CPUs the node claims     (default 8)
#   SLURM_LOCAL_PORT   slurmctld port; slurmd uses PORT+1 (default 6817)
#   SLURM_LOCAL_AUTH   none | munge             (default: none if available)
#   SLURM_LOCAL_WAIT   seconds to wait for idle (default 60)
set -uo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/jax_smddp_slurm}"
CPUS="${SLURM_LOCAL_CPUS:-8}"
PORT="${SLURM_LOCAL_PORT:-6817}"
WAIT="${SLURM_LOCAL_WAIT:-60}"
CONF="$DIR/slurm.conf"
NODE="$(hostname -s)"
ETC_CONF=/etc/slurm/slurm.conf

log() { echo "slurm_local: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

pid_alive() {  # pidfile expected-comm -> 0 if that process is alive
  read_pid "$1" "$2" >/dev/null
}

node_state() {
  SLURM_CONF="$CONF" timeout 10 sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1
}

node_usable() {
  case "$(node_state)" in
    idle|mixed|allocated|completing) return 0 ;;
    *) return 1 ;;
  esac
}

plugin_dir() {
  local d
  for d in /usr/lib/*/slurm-wlm /usr/lib/slurm-wlm /usr/lib/*/slurm /usr/lib64/slurm /usr/lib/slurm /usr/local/lib/slurm; do
    [[ -e "$d/select_cons_tres.so" ]] && { echo "$d"; return 0; }
  done
  return 1
}

install_slurm() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null && return 0
  [[ "$(id -u)" == 0 ]] || die "slurm is not installed and we are not root (need: apt-get install slurmctld slurmd slurm-client)"
  command -v apt-get >/dev/null || die "slurm is not installed and apt-get is not available"
  # libpmix-dev: srun --mpi=pmix (installed before slurmd starts, which loads it)
  local pkgs=(slurmctld slurmd slurm-client libpmix-dev) t0=$SECONDS
  log "installing ${pkgs[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q -o DPkg::Lock::Timeout=120 --no-install-recommends "${pkgs[@]}" >"/tmp/jax_smddp_slurm_apt.log" 2>&1; then
    apt-get update -q -o DPkg::Lock::Timeout=120 >>"/tmp/jax_smddp_slurm_apt.log" 2>&1
    apt-get install -y -q -o DPkg::Lock::Timeout=120 --no-install-recommends "${pkgs[@]}" >>"/tmp/jax_smddp_slurm_apt.log" 2>&1 ||
      { tail -n 20 /tmp/jax_smddp_slurm_apt.log >&2; die "apt-get install failed"; }
  fi
  log "installed in $((SECONDS - t0)) s"
}

choose_auth() {
  local want="${SLURM_LOCAL_AUTH:-}" pdir="$1"
  if [[ -z "$want" ]]; then
    if [[ -e "$pdir/auth_none.so" && -e "$pdir/cred_none.so" ]]; then want=none; else want=munge; fi
  fi
  echo "$want"
}

start_munge() {
  command -v munged >/dev/null || die "auth/munge chosen but munged is not installed"
  mkdir -p "$DIR/munge"
  chmod 700 "$DIR/munge"
  if pid_alive "$DIR/munge/munged.pid" munged; then return 0; fi
  if [[ ! -s "$DIR/munge/munge.key" ]]; then
    if command -v mungekey >/dev/null; then
      mungekey --create --keyfile="$DIR/munge/munge.key" --force >/dev/null 2>&1
    fi
    [[ -s "$DIR/munge/munge.key" ]] || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$DIR/munge/munge.key"
  fi
  munged --force \
    --socket="$DIR/munge/munge.socket" \
    --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" \
    --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed" 9>&- </dev/null >>"$DIR/munge/munged.out" 2>&1 ||
    { cat "$DIR/munge/munged.log" >&2 2>/dev/null; die "munged failed to start"; }
}

write_conf() {
  local auth="$1"
  local authlines
  if [[ "$auth" == none ]]; then
    authlines="AuthType=auth/none
CredType=cred/none"
  else
    authlines="AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge"
  fi
  cat >"$CONF.tmp" <<EOF
# Generated by scripts/slurm_local.sh; one-node test cluster, no cgroups.
ClusterName=jaxsmddp
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
$authlines
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=30
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  mv -f "$CONF.tmp" "$CONF"
}

show_logs() {
  local f
  for f in "$DIR"/log/slurmctld.log "$DIR"/log/slurmd.log "$DIR"/log/*.out "$DIR"/munge/munged.log; do
    [[ -s "$f" ]] && { echo "---- $f (tail)" >&2; tail -n 25 "$f" >&2; }
  done
}

link_etc_conf() {
  [[ "$(id -u)" == 0 ]] || return 0
  if [[ ! -e "$ETC_CONF" && ! -L "$ETC_CONF" ]]; then
    mkdir -p "$(dirname "$ETC_CONF")" && ln -s "$CONF" "$ETC_CONF" 2>/dev/null || true
  fi
}

unlink_etc_conf() {
  if [[ -L "$ETC_CONF" && "$(readlink "$ETC_CONF")" == "$CONF" ]]; then
    rm -f "$ETC_CONF"
  fi
}

cmd_start() {
  local t0=$SECONDS
  install_slurm
  local pdir auth
  pdir="$(plugin_dir)" || die "cannot find the Slurm plugin directory"
  auth="$(choose_auth "$pdir")"

  if pid_alive "$DIR/run/slurmctld.pid" slurmctld && pid_alive "$DIR/run/slurmd.pid" slurmd && [[ -s "$CONF" ]] && node_usable; then
    log "already running (node $NODE $(node_state))"
    link_etc_conf
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  # Partially running (one daemon died, or node not usable): restart cleanly.
  cmd_stop quiet

  [[ "$(id -u)" == 0 ]] || die "must run as root (SlurmUser=root, SlurmdUser=root)"
  rm -rf "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
  [[ "$auth" == munge ]] && start_munge
  write_conf "$auth"

  export SLURM_CONF="$CONF"
  # Both daemons fork into the background themselves; stdio goes to files so a
  # caller capturing our output does not wait on the daemons.
  slurmctld -i 9>&- </dev/null >"$DIR/log/slurmctld.out" 2>&1 ||
    { show_logs; die "slurmctld failed to start"; }
  slurmd -N "$NODE" 9>&- </dev/null >"$DIR/log/slurmd.out" 2>&1 ||
    { show_logs; die "slurmd failed to start"; }

  local deadline=$((SECONDS + WAIT)) st=""
  while ((SECONDS < deadline)); do
    st="$(node_state)"
    case "$st" in
      idle|mixed|allocated) break ;;
      down*|drain*|fail*)
        # ReturnToService=2 normally prevents this; resume once and keep waiting.
        SLURM_CONF="$CONF" scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  if ! node_usable; then
    show_logs
    die "node $NODE not usable after ${WAIT}s (state: '${st:-no answer}')"
  fi
  link_etc_conf
  log "ready in $((SECONDS - t0)) s: node $NODE $st, $CPUS CPUs, auth/$auth, conf $CONF"
  echo "export SLURM_CONF=$CONF"
}

read_pid() {  # pidfile expected-comm -> pid, if that process is alive and is what we expect
  local f="$1" name="$2" p
  [[ -s "$f" ]] || return 1
  p="$(cat "$f" 2>/dev/null)" || return 1
  [[ "$p" =~ ^[0-9]+$ ]] && kill -0 "$p" 2>/dev/null || return 1
  [[ "$(cat "/proc/$p/comm" 2>/dev/null)" == "$name"* ]] || return 1
  echo "$p"
}

wait_gone() {  # pid... ; wait up to 10 s for them to exit, then SIGKILL
  local p i alive
  for ((i = 0; i < 50; i++)); do
    alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    sleep 0.2
  done
  for p in "$@"; do kill -KILL "$p" 2>/dev/null; done
  sleep 0.2
}

cmd_stop() {
  local quiet="${1:-}" ctld sd mg pids=()
  # Read the pids first: the daemons delete their pid files before they exit.
  ctld="$(read_pid "$DIR/run/slurmctld.pid" slurmctld)" && pids+=("$ctld")
  sd="$(read_pid "$DIR/run/slurmd.pid" slurmd)" && pids+=("$sd")
  mg="$(read_pid "$DIR/munge/munged.pid" munged)" && pids+=("$mg")
  if [[ -s "$CONF" && -n "$ctld" ]]; then
    # Cancel jobs first so their tasks do not outlive the cluster.
    # Wait for the steps to report completion, else a slurmstepd outlives
    # slurmctld and keeps retrying to reach it.
    if [[ -n "$(SLURM_CONF="$CONF" timeout 10 squeue -h -o %i 2>/dev/null)" ]]; then
      SLURM_CONF="$CONF" timeout 10 scancel --quiet --user=root >/dev/null 2>&1 || true
      local i
      for ((i = 0; i < 60; i++)); do
        [[ -z "$(SLURM_CONF="$CONF" timeout 10 squeue -h -o %i 2>/dev/null)" ]] && break
        sleep 0.25
      done
    fi
    SLURM_CONF="$CONF" timeout 10 scontrol shutdown >/dev/null 2>&1 || true
  fi
  [[ -n "$ctld" || -n "$sd" ]] && wait_gone ${ctld:+"$ctld"} ${sd:+"$sd"}
  # Whatever did not answer the shutdown RPC gets SIGTERM, then SIGKILL.
  local p left=()
  for p in ${ctld:+"$ctld"} ${sd:+"$sd"} ${mg:+"$mg"}; do
    kill -0 "$p" 2>/dev/null && { kill -TERM "$p" 2>/dev/null; left+=("$p"); }
  done
  ((${#left[@]})) && wait_gone "${left[@]}"
  rm -f "$DIR/run/slurmctld.pid" "$DIR/run/slurmd.pid" "$DIR/munge/munged.pid"
  unlink_etc_conf
  [[ -n "$quiet" ]] || log "stopped${pids[*]:+ (pids ${pids[*]})}"
}

cmd_status() {
  if [[ -s "$CONF" ]] && pid_alive "$DIR/run/slurmctld.pid" slurmctld && pid_alive "$DIR/run/slurmd.pid" slurmd && node_usable; then
    log "running: node $NODE $(node_state), conf $CONF"
    return 0
  fi
  log "not running"
  return 1
}

# Serialize concurrent start/stop calls (e.g. two test sessions at once).
if [[ "${1:-start}" =~ ^(start|stop|restart)$ ]] && command -v flock >/dev/null; then
  exec 9>"$DIR.lock" && flock -w 120 9 || die "could not lock $DIR.lock"
fi

case "${1:-start}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  restart) cmd_stop quiet; cmd_start ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  logs) show_logs ;;
  *) echo "usage: $0 [start|stop|restart|status|env|logs]" >&2; exit 2 ;;
esac
