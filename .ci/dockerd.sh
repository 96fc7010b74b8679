#!/usr/bin/env bash
# A private Docker daemon for the daemon tests: start, stop, env, status.
#
#   eval "$(.ci/dockerd.sh start)"   # prints: export DOCKER_HOST=unix://...
#   .ci/dockerd.sh stop              # stops it; tagged images stay for the next start
#   .ci/dockerd.sh stop --purge      # stops it and deletes its images
#
# Installs Debian's docker.io when dockerd is missing. Flags that work on these
# machines (no nested overlayfs, no iptables): vfs storage, no bridge. The data root
# lives in the sm12x cache so stand-in images survive between runs; the socket and
# the exec root live under /run (socket paths must stay short).
# Everything but the final export line goes to stderr.
set -euo pipefail

CACHE=${SM12X_BUNDLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sm12x-bundle}
DATA_ROOT=${SM12X_DOCKERD_DATA:-$CACHE/dockerd}
RUN_DIR=${SM12X_DOCKERD_RUN:-/run/sm12x-dockerd}
SOCK=$RUN_DIR/docker.sock
PIDFILE=$RUN_DIR/dockerd.pid
LOG=$DATA_ROOT.log
WAIT_S=${SM12X_DOCKERD_WAIT:-60}

say() { echo "dockerd.sh: $*" >&2; }

running() {
  [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null
}

answers() {
  docker -H "unix://$SOCK" version --format '{{.Server.Version}}' >/dev/null 2>&1
}

# docker.io for the daemon; debootstrap for the tests' stand-in base image
# (tests/docker_support.py), which no registry can provide here.
install() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [ ${#missing[@]} = 0 ] && return
  [ "$(id -u)" = 0 ] || { say "missing ${missing[*]}, and only root can install them"; exit 1; }
  say "installing Debian's ${missing[*]}"
  apt-get update -q >&2
  # A package the install pulls in may fail its own post-install step on this machine
  # (seen here: python3's rtupdate hook, for an unrelated installed package); what counts
  # is that the two commands are there afterwards.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 ||
    say "apt-get reported an error; checking that dockerd and debootstrap are installed anyway"
  command -v dockerd >/dev/null && command -v debootstrap >/dev/null ||
    { say "dockerd or debootstrap is still missing after apt-get"; exit 1; }
}

start() {
  if running && answers; then
    echo "export DOCKER_HOST=unix://$SOCK"
    return
  fi
  install
  mkdir -p "$DATA_ROOT" "$RUN_DIR"
  say "starting dockerd (data root $DATA_ROOT, log $LOG)"
  # setsid: the daemon must not die with the shell that started it.
  setsid dockerd \
    --host "unix://$SOCK" \
    --data-root "$DATA_ROOT" \
    --exec-root "$RUN_DIR/exec" \
    --pidfile "$PIDFILE" \
    --storage-driver vfs \
    --iptables=false --ip6tables=false --bridge=none \
    >"$LOG" 2>&1 </dev/null &
  for _ in $(seq "$WAIT_S"); do
    if answers; then
      say "dockerd $(docker -H "unix://$SOCK" version --format '{{.Server.Version}}') answers on $SOCK"
      echo "export DOCKER_HOST=unix://$SOCK"
      return
    fi
    sleep 1
  done
  say "dockerd did not answer within ${WAIT_S} s; the end of $LOG:"
  tail -n 20 "$LOG" >&2 || true
  exit 1
}

stop() {
  if running; then
    local pid
    # Tagged images (the stand-ins) stay for the next run; what builds left untagged
    # goes (on vfs storage every layer is a full copy of the image).
    docker -H "unix://$SOCK" image prune -f >&2 || true
    pid=$(cat "$PIDFILE")
    say "stopping dockerd (pid $pid)"
    kill "$pid"
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && { say "dockerd ignored SIGTERM: SIGKILL"; kill -9 "$pid"; }
  fi
  rm -f "$PIDFILE" "$SOCK"
  if [ "${1:-}" = --purge ]; then
    say "deleting $DATA_ROOT"
    rm -rf "$DATA_ROOT"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop "${2:-}" ;;
  env) echo "export DOCKER_HOST=unix://$SOCK" ;;
  status) if running && answers; then say "running on $SOCK"; else say "not running"; exit 1; fi ;;
  *) echo "usage: $0 start|stop [--purge]|env|status" >&2; exit 2 ;;
esac
