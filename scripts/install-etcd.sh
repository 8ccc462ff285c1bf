#!/usr/bin/env bash
# Installs the etcd server (Debian's `etcd-server`, 3.4 on bookworm) for the cluster-directory
# tests (tests/cluster_*.rs start their own etcd on a free loopback port in a temp dir; nothing
# runs as a service). Idempotent; needs root (CI runs as root on a clean machine) or sudo.
set -euo pipefail
find_etcd() {
  command -v etcd 2>/dev/null || { [ -x /usr/bin/etcd ] && echo /usr/bin/etcd; } || true
}
if [ -n "$(find_etcd)" ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
# The package's postinst may try to start a service: keep it from doing so (no init in CI).
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
  $sudo chmod +x /usr/sbin/policy-rc.d
  trap '$sudo rm -f /usr/sbin/policy-rc.d' EXIT
fi
$sudo apt-get install -y -q --no-install-recommends etcd-server >/dev/null 2>&1 || {
  $sudo apt-get update -q >/dev/null
  $sudo apt-get install -y -q --no-install-recommends etcd-server >/dev/null
}
[ -n "$(find_etcd)" ] || { echo "etcd-server installed but no etcd binary found" >&2; exit 1; }
echo "etcd ready: $(find_etcd)" >&2
