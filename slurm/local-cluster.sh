#!/usr/bin/env bash
# A real Slurm cluster on this machine: three emulated nodes (n1-n3; 4 CPUs each) with accounting
# (slurmdbd + a private MariaDB on a loopback port), for the tests, CI and trying hpc_train without a
# cluster. Debian/Ubuntu, as root.
#
#   slurm/local-cluster.sh start    install what is missing, configure, start, wait until all nodes idle
#   slurm/local-cluster.sh stop     stop the daemons this script started (by their recorded PIDs)
#   slurm/local-cluster.sh status   show the daemons and sinfo
#
# Idempotent: `start` on a running cluster only checks it. State, logs and PIDs live in $STATE_DIR, and
# so does the accounting database's password: random, made by the first `start`, root-only (mode 600).
set -euo pipefail

STATE_DIR=${HPC_TRAIN_SLURM_STATE:-/var/lib/hpc-train-slurm}
DB_PASSWORD_FILE=$STATE_DIR/db-password
CLUSTER=hpctrain
NODES=(n1 n2 n3)
CPUS_PER_NODE=4
MEM_PER_NODE_MB=8000
# The main scheduler every second, not every minute: a requeued job starts once its BeginTime (cred_expire
# after the requeue) passes, not up to a minute later (a preempted test job waited 36 s so).
SCHEDULER_PARAMETERS=bf_interval=1,sched_interval=1,sched_min_interval=100000
CTLD_PORT=16817
DBD_PORT=16819
DB_PORT=16306
NODE_PORT_BASE=17001
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)
DAEMONS=(munged mariadbd slurmdbd slurmctld "${NODES[@]/#/slurmd-}")

log() { printf '[local-cluster] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Liveness from /proc: nothing reaps orphans in these containers, so a dead daemon can linger as a zombie
# that `kill -0` still reports alive.
alive() {
    local pid=$1
    [[ -r /proc/$pid/status ]] && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status"
}

pid_of() { cat "$STATE_DIR/pids/$1" 2>/dev/null || true; }

running() {
    local pid
    pid=$(pid_of "$1")
    [[ -n $pid ]] && alive "$pid"
}

spawn() {  # spawn NAME COMMAND...: run in the background, logs in $STATE_DIR/log, PID recorded
    local name=$1
    shift
    if running "$name"; then return; fi
    nohup "$@" </dev/null >>"$STATE_DIR/log/$name.log" 2>&1 &
    echo $! >"$STATE_DIR/pids/$name"
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds=$1 what=$2
    shift 2
    for ((i = 0; i < seconds * 5; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    die "timed out after ${seconds}s waiting for $what (logs: $STATE_DIR/log)"
}

install_packages() {
    local missing=()
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [[ ${#missing[@]} -eq 0 ]] && return
    [[ $(id -u) -eq 0 ]] || die "installing ${missing[*]} needs root"
    log "installing ${missing[*]}"
    # Keep the packages from starting their own daemons: this script starts and owns them.
    local policy=/usr/sbin/policy-rc.d restore=""
    if [[ -e $policy ]]; then restore=$(mktemp) && cp -p "$policy" "$restore"; fi
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    if [[ -n $restore ]]; then mv "$restore" "$policy"; else rm -f "$policy"; fi
}

# The password slurmdbd logs into MariaDB with: made once per machine (per $STATE_DIR, which also holds
# the database), so no two installs share one; hex, so it needs no quoting in SQL or slurmdbd.conf.
db_password() {
    if [[ ! -s $DB_PASSWORD_FILE ]]; then
        local tmp
        tmp=$(mktemp "$DB_PASSWORD_FILE.XXXXXX")  # mode 600 from the start
        od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >"$tmp"
        mv "$tmp" "$DB_PASSWORD_FILE"
    fi
    chmod 600 "$DB_PASSWORD_FILE"
    local password
    password=$(<"$DB_PASSWORD_FILE")
    [[ $password =~ ^[[:xdigit:]]{32}$ ]] || die "$DB_PASSWORD_FILE is not a generated password; delete it for a new one"
    printf '%s' "$password"
}

write_config() {
    mkdir -p "$STATE_DIR"/{pids,log,ctld,spool,mysql} /etc/slurm /run/munge
    local db_pass
    db_pass=$(db_password)
    local nodelist="n[1-${#NODES[@]}]" last_port=$((NODE_PORT_BASE + ${#NODES[@]} - 1))
    cat >/etc/slurm/slurm.conf <<EOF
# Written by hpc_train's slurm/local-cluster.sh: ${#NODES[@]} emulated nodes on this machine.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool/%n
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=$SCHEDULER_PARAMETERS
MessageTimeout=10
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$nodelist NodeHostname=localhost NodeAddr=127.0.0.1 Port=$NODE_PORT_BASE-$last_port CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE_MB State=UNKNOWN
PartitionName=debug Nodes=$nodelist Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=${NODES[0]},${NODES[1]} MaxTime=00:10:00 MaxNodes=1 State=UP
EOF
    install -m 600 /dev/null /etc/slurm/slurmdbd.conf  # holds the password: never readable by others
    cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$STATE_DIR/slurmdbd.pid
LogFile=$STATE_DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$db_pass
StorageLoc=slurm_acct_db
EOF
    # The emulated node names must resolve.
    grep -qE "^127\.0\.0\.1[[:space:]]+${NODES[0]}([[:space:]]|$)" /etc/hosts ||
        echo "127.0.0.1 ${NODES[*]}" >>/etc/hosts
}

start_munge() {
    [[ -s /etc/munge/munge.key ]] || { mungekey --create --keyfile=/etc/munge/munge.key && chown munge: /etc/munge/munge.key; }
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge: /run/munge /var/log/munge /var/lib/munge
    spawn munged runuser -u munge -- /usr/sbin/munged --foreground
    wait_for 10 munge bash -c 'munge -n | unmunge'
}

start_mariadb() {
    local sock=$STATE_DIR/mysql.sock
    if [[ ! -d $STATE_DIR/mysql/mysql ]]; then
        mariadb-install-db --user=root --datadir="$STATE_DIR/mysql" --auth-root-authentication-method=socket \
            >>"$STATE_DIR/log/mariadb-install.log" 2>&1
    fi
    spawn mariadbd /usr/sbin/mariadbd --user=root --datadir="$STATE_DIR/mysql" --socket="$sock" \
        --port=$DB_PORT --bind-address=127.0.0.1 --skip-name-resolve --innodb-buffer-pool-size=64M
    wait_for 30 mariadb mariadb --socket="$sock" -e "SELECT 1"
    # ALTER too: a database made before the password was generated has the user with an older one.
    # On stdin, not the command line, so the password never shows in the process list.
    local db_pass
    db_pass=$(db_password)
    mariadb --socket="$sock" <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'%' IDENTIFIED BY '$db_pass';
ALTER USER 'slurm'@'%' IDENTIFIED BY '$db_pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'%';
FLUSH PRIVILEGES;
EOF
}

nodes_idle() {
    local states
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null) || return 1  # a node in two partitions is listed twice
    [[ $(sort -u <<<"$states" | grep -c ' idle') -eq ${#NODES[@]} ]]
}

all_running() {
    for d in "${DAEMONS[@]}"; do running "$d" || return 1; done
}

start() {
    # a running cluster is kept where its configuration is this script's (the parameters, the partitions)
    if all_running && nodes_idle && grep -qxF "SchedulerParameters=$SCHEDULER_PARAMETERS" /etc/slurm/slurm.conf &&
        grep -q "^PartitionName=short " /etc/slurm/slurm.conf; then
        log "already running: $(sinfo -h -o '%D nodes %T' | tr '\n' ' ')"
        return
    fi
    install_packages
    stop_quietly
    write_config
    start_munge
    start_mariadb
    spawn slurmdbd /usr/sbin/slurmdbd -D
    wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true
    spawn slurmctld /usr/sbin/slurmctld -D -i
    wait_for 30 slurmctld scontrol ping
    for node in "${NODES[@]}"; do
        mkdir -p "$STATE_DIR/spool/$node"
        spawn "slurmd-$node" /usr/sbin/slurmd -D -N "$node"
    done
    wait_for 60 "all nodes idle" nodes_idle
    log "up: $(sinfo -h -o '%D nodes %T, partition %P' | tr '\n' ' ')"
}

stop_quietly() {
    local order=("${NODES[@]/#/slurmd-}" slurmctld slurmdbd mariadbd munged) pid
    for name in "${order[@]}"; do
        pid=$(pid_of "$name")
        if [[ -n $pid ]] && alive "$pid"; then
            kill "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do alive "$pid" || break; sleep 0.2; done
            alive "$pid" && kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$STATE_DIR/pids/$name"
    done
}

status() {
    for d in "${DAEMONS[@]}"; do
        if running "$d"; then echo "$d: running (pid $(pid_of "$d"))"; else echo "$d: stopped"; fi
    done
    sinfo 2>/dev/null || true
}

case ${1:-} in
    start) start ;;
    stop) stop_quietly; log "stopped" ;;
    status) status ;;
    *) echo "usage: $0 {start|stop|status}" >&2; exit 2 ;;
esac
