#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for the `slurm` tests (tests/sweep/test_slurm.py) and for
# trying `attnres-run -m hydra/launcher=slurm` without a real cluster. Debian/Ubuntu, as root, no
# systemd needed: the daemons are started by hand and stopped by their PIDs.
#
#   experiments/slurm/cluster.sh up       # install the packages if missing, write the config, start
#   experiments/slurm/cluster.sh status   # is it up? (exit 0 when the node answers)
#   experiments/slurm/cluster.sh down     # stop the daemons this script started
#
# `up` installs slurm-wlm, munge, slurmdbd and mariadb-server with apt-get (accounting: submitit
# polls job states with sacct), writes /etc/slurm/slurm.conf and slurmdbd.conf from the templates
# beside this script for this host (`hostname -s`, `nproc`, `free -m`), and starts munged, mariadbd,
# slurmdbd, slurmctld and slurmd. State, logs and PID files go to $ATTNRES_SLURM_STATE
# (default /var/lib/attnres-slurm). It refuses to replace a slurm.conf it did not write.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
state="${ATTNRES_SLURM_STATE:-/var/lib/attnres-slurm}"
etc=/etc/slurm
marker="# written by experiments/slurm/cluster.sh"

say() { echo "cluster.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND until it succeeds
  local limit=$1 what=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      say "error: $what did not come up within ${limit} s; see $state/log/"
      return 1
    fi
    sleep 0.5
  done
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null && command -v munged >/dev/null \
     && command -v mariadbd >/dev/null; then
    return
  fi
  [ "$(id -u)" = 0 ] || die "the SLURM packages are missing and installing them needs root; run as root"
  command -v apt-get >/dev/null || die "no apt-get: install slurm-wlm, munge, slurmdbd, mariadb-server by hand"
  say "installing slurm-wlm munge slurmdbd mariadb-server (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge slurmdbd mariadb-server >/dev/null
}

write_config() {
  local host cpus mem_mb
  host="$(hostname -s)"
  cpus="$(nproc)"
  # RealMemory below what the machine has: 90% of the total, leaving room for the daemons
  mem_mb="$(free -m | awk '/^Mem:/ {print int($2 * 0.9)}')"
  mkdir -p "$etc" "$state/log" "$state/slurmd" "$state/slurmctld"
  for conf in slurm.conf slurmdbd.conf; do
    if [ -f "$etc/$conf" ] && ! grep -q "^$marker" "$etc/$conf"; then
      die "$etc/$conf exists and was not written by this script; move it aside to use the test cluster"
    fi
    { echo "$marker"
      sed -e "s|@HOST@|$host|g" -e "s|@CPUS@|$cpus|g" -e "s|@MEM_MB@|$mem_mb|g" -e "s|@STATE@|$state|g" \
        "$here/$conf.in"; } > "$etc/$conf.tmp"
    mv "$etc/$conf.tmp" "$etc/$conf"
  done
  chmod 600 "$etc/slurmdbd.conf"
  say "config for $host: $cpus CPUs, RealMemory $mem_mb MB -> $etc/slurm.conf"
}

start_munge() {
  alive "$state/munged.pid" && return
  if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey -c -f -k /etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
  fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- munged --pid-file=/run/munge/munged.pid
  wait_for 20 munged test -s /run/munge/munged.pid
  cp /run/munge/munged.pid "$state/munged.pid"
  wait_for 20 munged bash -c 'munge -n | unmunge'
}

start_mariadb() {
  if ! alive "$state/mariadbd.pid"; then
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    # own log; only the local socket (no TCP port)
    nohup mariadbd --user=mysql --skip-networking --socket=/run/mysqld/mysqld.sock \
      --pid-file=/run/mysqld/mariadbd.pid >"$state/log/mariadbd.log" 2>&1 &
    echo $! > "$state/mariadbd.pid"
    wait_for 60 mariadbd mariadb --socket=/run/mysqld/mysqld.sock -uroot -e 'select 1'
  fi
  mariadb --socket=/run/mysqld/mysqld.sock -uroot <<'SQL'
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'attnres-test';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
SQL
}

start_slurm() {
  if ! alive "$state/slurmdbd.pid"; then
    slurmdbd
    wait_for 60 slurmdbd sacctmgr -n list cluster
  fi
  sacctmgr -i -Q add cluster attnres >/dev/null 2>&1 || true
  if ! alive "$state/slurmctld.pid"; then
    slurmctld
    wait_for 60 slurmctld scontrol ping
  fi
  if ! alive "$state/slurmd.pid"; then
    slurmd
  fi
  wait_for 60 "the node" bash -c "sinfo -h -N -o %t | grep -qE '^(idle|mix|alloc)'"
  # a node left down or drained by an earlier run of the daemons: back to service
  scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true
}

up() {
  install_packages
  write_config
  start_munge
  start_mariadb
  start_slurm
  say "up: $(sinfo -h -o '%P %D node(s) %c CPUs %m MB %t')"
}

down() {  # stop by PID, in the reverse order of starting; each gets SIGTERM, then SIGKILL after 20 s
  local name pidfile pid
  for name in slurmd slurmctld slurmdbd mariadbd munged; do
    pidfile="$state/$name.pid"
    alive "$pidfile" || { rm -f "$pidfile"; continue; }
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
    say "stopped $name (pid $pid)"
  done
}

status() {
  command -v sinfo >/dev/null || { say "not installed (no sinfo)"; return 1; }
  timeout 10 sinfo -h -N -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)' || { say "not up"; return 1; }
  timeout 10 sacct -n -X -S now >/dev/null 2>&1 || { say "up, but accounting (sacct) does not answer"; return 1; }
  say "up: $(sinfo -h -o '%P %D node(s) %c CPUs %m MB %t')"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
