# tests/integration/lib/netns.bash: several "hosts" on this machine, made of network namespaces joined by
# veth pairs to a bridge that lives in a namespace of its own (so no address or link is added outside the
# namespaces this file makes). Source it after svc.bash (it uses $T and the cleanup trap):
#
#   netns_setup 3                 # hosts 1..3: namespaces cbN-h1.., addresses $(netns_addr 1).., or exit 77
#   netns_start 2 blendA ENV=... -- build/bin/cb-blend ARGS...   # in host 2, log in $T/blendA.log
#   netns_exec 1 build/bin/cbctl health                           # a command in host 1, foreground
#   netns_partition 3; netns_heal 3                               # host 3's link down / up
#   netns_kill9 blendA
#
# Every namespace is deleted and every process started here killed at exit (netns_cleanup runs from
# svc_cleanup's trap through NETNS_CLEANUP). Addresses: 10.77.X.N/24 with X random per run, so that two
# runs at once do not collide.

NETNS_PREFIX=""
NETNS_HOSTS=0
NETNS_SUBNET=""
declare -A NETNS_PID=()

netns_cleanup() {
  local name pid i
  for name in "${!NETNS_PID[@]}"; do kill -TERM "${NETNS_PID[$name]}" 2>/dev/null; done
  for name in "${!NETNS_PID[@]}"; do
    pid=${NETNS_PID[$name]}
    for i in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
  done
  NETNS_PID=()
  [ -n "$NETNS_PREFIX" ] || return 0
  for i in $(seq 1 "$NETNS_HOSTS"); do ip netns del "$NETNS_PREFIX-h$i" 2>/dev/null; done
  ip netns del "$NETNS_PREFIX-sw" 2>/dev/null
  NETNS_PREFIX=""
}

# netns_addr N: host N's address.
netns_addr() { echo "$NETNS_SUBNET.$1"; }
netns_name() { echo "$NETNS_PREFIX-h$1"; }

# netns_setup N: N hosts on one bridge; exit 77 when namespaces cannot be made here (not root, no ip).
netns_setup() {
  local n=$1 i ns
  command -v ip >/dev/null || { echo "skip: no ip(8)"; exit 77; }
  NETNS_PREFIX="cb$$"
  NETNS_SUBNET="10.77.$((RANDOM % 250 + 1))"
  local prev_trap
  prev_trap=$(trap -p EXIT | sed "s/^trap -- '\(.*\)' EXIT$/\1/")
  trap "netns_cleanup; $prev_trap" EXIT
  if ! ip netns add "$NETNS_PREFIX-sw" 2>/dev/null; then echo "skip: cannot make network namespaces here"; exit 77; fi
  ip -n "$NETNS_PREFIX-sw" link add br0 type bridge || return 1
  ip -n "$NETNS_PREFIX-sw" link set br0 up || return 1
  ip -n "$NETNS_PREFIX-sw" link set lo up
  for i in $(seq 1 "$n"); do
    ns="$NETNS_PREFIX-h$i"
    ip netns add "$ns" || return 1
    NETNS_HOSTS=$i
    ip -n "$ns" link set lo up
    # the pair is made inside the host's namespace, then one end moves to the switch
    ip -n "$ns" link add eth0 type veth peer name "p$i" || return 1
    ip -n "$ns" link set "p$i" netns "$NETNS_PREFIX-sw" || return 1
    ip -n "$NETNS_PREFIX-sw" link set "p$i" master br0 || return 1
    ip -n "$NETNS_PREFIX-sw" link set "p$i" up || return 1
    ip -n "$ns" addr add "$NETNS_SUBNET.$i/24" dev eth0 || return 1
    ip -n "$ns" link set eth0 up || return 1
  done
  # the links are up when host 1 reaches every other host over TCP (bounded)
  for i in $(seq 2 "$n"); do netns_reach 1 "$i" 5 || { echo "FAIL: host $i not reachable from host 1"; return 1; }; done
}

# netns_reach FROM TO [SECONDS]: a TCP connection from host FROM to a listener in host TO succeeds within
# SECONDS (default 3). Status 0 or 1.
netns_reach() {
  local from=$1 to=$2 limit=${3:-3} port=$((RANDOM % 10000 + 40000))
  ip netns exec "$(netns_name "$to")" timeout "$limit" python3 -c "
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('$NETNS_SUBNET.$to', $port)); s.listen(4)
c, _ = s.accept(); c.close()" 2>/dev/null &
  local lpid=$!
  ip netns exec "$(netns_name "$from")" timeout "$limit" python3 -c "
import socket, time, sys
t0 = time.time()
while time.time() - t0 < $limit - 0.5:
    try:
        socket.create_connection(('$NETNS_SUBNET.$to', $port), timeout=0.5).close(); sys.exit(0)
    except OSError:
        time.sleep(0.1)
sys.exit(1)" 2>/dev/null
  local rc=$?
  kill "$lpid" 2>/dev/null; wait "$lpid" 2>/dev/null
  return $rc
}

# netns_start HOST NAME [VAR=VALUE...] -- BINARY [ARGS...]: a background process in host HOST.
netns_start() {
  local host=$1 name=$2; shift 2
  local envs=()
  while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; break; fi
    envs+=("$1"); shift
  done
  ip netns exec "$(netns_name "$host")" env "${envs[@]}" "$@" >>"$T/$name.log" 2>&1 &
  NETNS_PID[$name]=$!
}

# netns_exec HOST COMMAND...: runs COMMAND in host HOST (foreground; its status).
netns_exec() { local host=$1; shift; ip netns exec "$(netns_name "$host")" "$@"; }

netns_pid() { echo "${NETNS_PID[$1]:-}"; }

# netns_kill9 NAME: SIGKILL, reaped, forgotten.
netns_kill9() {
  local pid=${NETNS_PID[$1]:-}
  [ -n "$pid" ] || return 0
  kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  unset "NETNS_PID[$1]"
}

# netns_stop NAME: SIGTERM, wait up to 10 s, then SIGKILL.
netns_stop() {
  local pid=${NETNS_PID[$1]:-} i
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null
  for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  unset "NETNS_PID[$1]"
}

# netns_partition HOST / netns_heal HOST: host HOST's link to the bridge down / up.
netns_partition() { ip -n "$NETNS_PREFIX-sw" link set "p$1" down; }
netns_heal() { ip -n "$NETNS_PREFIX-sw" link set "p$1" up; }
