#!/usr/bin/env bash
# A private, loopback-only RabbitMQ broker for the consistent-hash harness
# (`shardq-bench chx --rabbitmq ...`) and its test.
#
#   scripts/rabbitmq.sh start  [PORT]   install if missing, start, wait for AMQP
#   scripts/rabbitmq.sh stop   [PORT]   stop the broker started on PORT
#   scripts/rabbitmq.sh status [PORT]   exit 0 if it accepts AMQP on PORT
#
# PORT defaults to 5672. Every file the broker writes (database, logs, cookie,
# plugin list, pid) lives under one state directory, by default
# ${TMPDIR:-/tmp}/shardq-rabbitmq-PORT (override with SHARDQ_RABBITMQ_DIR), so
# nothing under /etc or /var/lib is read or changed after the package install.
# AMQP, Erlang distribution and epmd all listen on 127.0.0.1 only.
set -euo pipefail

PORT="${2:-5672}"
STATE_DIR="${SHARDQ_RABBITMQ_DIR:-${TMPDIR:-/tmp}/shardq-rabbitmq-$PORT}"
NODE="shardq-$PORT@localhost"
# Erlang distribution port: RabbitMQ's usual rule (AMQP port + 20000).
DIST_PORT=$((PORT + 20000))
RMQ_BIN=/usr/lib/rabbitmq/bin

# Bounded waits, in seconds.
START_WAIT_S=90
STOP_WAIT_S=30

log() { echo "rabbitmq.sh: $*" >&2; }

case "$PORT" in
  '' | *[!0-9]*) log "PORT must be a number, got '$PORT'"; exit 2 ;;
esac

# The environment every RabbitMQ command runs with. HOME points into the
# state directory so the Erlang cookie is private too.
broker_env() {
  export HOME="$STATE_DIR"
  export RABBITMQ_NODENAME="$NODE"
  export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
  export RABBITMQ_NODE_PORT="$PORT"
  export RABBITMQ_DIST_PORT="$DIST_PORT"
  export ERL_EPMD_ADDRESS=127.0.0.1
  export RABBITMQ_MNESIA_BASE="$STATE_DIR/mnesia"
  export RABBITMQ_LOG_BASE="$STATE_DIR/log"
  export RABBITMQ_PID_FILE="$STATE_DIR/broker.pid"
  export RABBITMQ_ENABLED_PLUGINS_FILE="$STATE_DIR/enabled_plugins"
  # A config file that exists and is empty, so /etc/rabbitmq is never read.
  export RABBITMQ_CONFIG_FILE="$STATE_DIR/rabbitmq.conf"
  export RABBITMQ_ADVANCED_CONFIG_FILE="$STATE_DIR/advanced.config"
  export RABBITMQ_CONF_ENV_FILE="$STATE_DIR/rabbitmq-env.conf"
  # Distribution listens on loopback as well, not only epmd and AMQP.
  export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
}

install_if_missing() {
  if [ -x "$RMQ_BIN/rabbitmq-server" ]; then
    return
  fi
  log "rabbitmq-server is not installed; installing Debian's package"
  # Keep the package's own service (all interfaces, default port) from
  # starting: a policy-rc.d that refuses every start, only for this install.
  local made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    made_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q rabbitmq-server >&2
  if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
}

accepts_amqp() {
  # An AMQP 0-9-1 broker answers the protocol header with Connection.Start.
  timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT && printf 'AMQP\x00\x00\x09\x01' >&3 && head -c 8 <&3 >/dev/null" 2>/dev/null
}

broker_pid() {
  [ -s "$STATE_DIR/broker.pid" ] && cat "$STATE_DIR/broker.pid"
}

running() {
  local pid
  pid="$(broker_pid 2>/dev/null)" || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

start() {
  install_if_missing
  if running && accepts_amqp; then
    log "already running on 127.0.0.1:$PORT (node $NODE)"
    return
  fi
  mkdir -p "$STATE_DIR/mnesia" "$STATE_DIR/log"
  : >"$STATE_DIR/rabbitmq.conf"
  : >"$STATE_DIR/rabbitmq-env.conf"
  broker_env
  "$RMQ_BIN/rabbitmq-plugins" enable --offline rabbitmq_consistent_hash_exchange >"$STATE_DIR/log/plugins.out" 2>&1 || {
    cat "$STATE_DIR/log/plugins.out" >&2
    log "could not enable rabbitmq_consistent_hash_exchange"
    exit 1
  }
  # setsid: the broker outlives this script and gets its own process group.
  setsid "$RMQ_BIN/rabbitmq-server" </dev/null >"$STATE_DIR/log/console.out" 2>&1 &
  local waited=0
  until accepts_amqp; do
    if [ "$waited" -ge "$START_WAIT_S" ]; then
      tail -n 40 "$STATE_DIR/log/console.out" >&2 || true
      log "broker did not accept AMQP on 127.0.0.1:$PORT within ${START_WAIT_S}s"
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  # The listener opens before plugins finish booting; wait for full startup.
  "$RMQ_BIN/rabbitmqctl" -n "$NODE" await_startup --timeout "$START_WAIT_S" >/dev/null
  log "running on amqp://127.0.0.1:$PORT (node $NODE, state $STATE_DIR, after ~${waited}s)"
  echo "amqp://127.0.0.1:$PORT"
}

stop() {
  if ! running; then
    log "not running on port $PORT"
    return
  fi
  broker_env
  local pid
  pid="$(broker_pid)"
  timeout "$STOP_WAIT_S" "$RMQ_BIN/rabbitmqctl" -n "$NODE" stop >/dev/null 2>&1 || true
  local waited=0
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$waited" -ge "$STOP_WAIT_S" ]; then
      log "broker pid $pid did not stop within ${STOP_WAIT_S}s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 1
    waited=$((waited + 1))
  done
  rm -f "$STATE_DIR/broker.pid"
  # epmd was started by our node; end it only when no other node uses it.
  if command -v epmd >/dev/null && ! epmd -names 2>/dev/null | grep -q '^name '; then
    epmd -kill >/dev/null 2>&1 || true
  fi
  log "stopped (port $PORT)"
}

status() {
  if running && accepts_amqp; then
    echo "running: amqp://127.0.0.1:$PORT (node $NODE, pid $(broker_pid))"
  else
    echo "not running on port $PORT"
    return 1
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *)
    echo "usage: $0 start|stop|status [PORT]" >&2
    exit 2
    ;;
esac
