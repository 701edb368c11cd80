#!/usr/bin/env bash
# Starts or stops a Redis Cluster of three primaries on loopback, for the
# redisstore tests and the chaos demo:
#
#   .ci/redis-cluster.sh start DIR BASEPORT   # ports BASEPORT..BASEPORT+2
#   .ci/redis-cluster.sh stop DIR BASEPORT
#
# DIR holds the nodes' cluster config files, logs and pid files (made if
# missing). start waits until `cluster info` says cluster_state:ok and
# prints the addresses, comma-separated, for SAFERETRY_REDIS_CLUSTER_ADDRS.
# Nothing is persisted (no RDB, no AOF): the tests and the chaos demo open
# their stores with redisstore.WithMemoryOnly(true), which accepts that;
# stop shuts the nodes down and removes their files.
set -euo pipefail
cmd=${1:?usage: redis-cluster.sh start|stop DIR BASEPORT}
dir=${2:?usage: redis-cluster.sh start|stop DIR BASEPORT}
base=${3:?usage: redis-cluster.sh start|stop DIR BASEPORT}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
ports="$base $((base + 1)) $((base + 2))"

case "$cmd" in
start)
  for p in $ports; do
    if redis-cli -p "$p" ping >/dev/null 2>&1; then
      echo "redis-cluster.sh: port $p already has a Redis (stop it, or pick another BASEPORT)"; exit 1
    fi
  done
  addrs=""
  for p in $ports; do
    rm -f "$dir/nodes-$p.conf"
    redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes \
      --cluster-config-file "$dir/nodes-$p.conf" --save "" --appendonly no \
      --dir "$dir" --logfile "$dir/redis-$p.log" --pidfile "$dir/redis-$p.pid" --daemonize yes
    addrs="$addrs 127.0.0.1:$p"
  done
  for p in $ports; do
    for _ in $(seq 1 50); do
      redis-cli -p "$p" ping >/dev/null 2>&1 && break
      sleep 0.1
    done
  done
  # shellcheck disable=SC2086
  redis-cli --cluster create $addrs --cluster-replicas 0 --cluster-yes >"$dir/create.log" 2>&1 ||
    { cat "$dir/create.log"; exit 1; }
  for p in $ports; do
    ok=""
    for _ in $(seq 1 100); do
      if redis-cli -p "$p" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; then ok=1; break; fi
      sleep 0.1
    done
    [ -n "$ok" ] || { echo "redis cluster node $p: cluster_state is not ok"; exit 1; }
  done
  echo "$addrs" | sed 's/^ //; s/ /,/g'
  ;;
stop)
  for p in $ports; do
    redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true
  done
  for p in $ports; do
    for _ in $(seq 1 50); do
      redis-cli -p "$p" ping >/dev/null 2>&1 || break
      sleep 0.1
    done
    rm -f "$dir/nodes-$p.conf" "$dir/redis-$p.log" "$dir/redis-$p.pid"
  done
  rm -f "$dir/create.log"
  ;;
*)
  echo "usage: redis-cluster.sh start|stop DIR BASEPORT"; exit 2
  ;;
esac
