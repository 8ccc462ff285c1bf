#!/usr/bin/env bash
# Multi-host on one machine: prefill and decode in two network namespaces joined by a veth pair.
#
#   sudo examples/netns/run.sh [tcp|tls|quic ...]      (default: tcp tls quic)
#
# Creates namespaces tsync-<pid>-p (10.77.0.1/24) and tsync-<pid>-d (10.77.0.2/24), runs
# `tpu-sync prefill` in the first and `tpu-sync decode` in the second for each transport (tls and
# quic authenticate with a fresh random 32-byte pre-shared key), and removes everything on exit,
# also on failure or Ctrl-C.
# Traffic flows only over the veth pair. Needs root and iproute2.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${TPU_SYNC_BIN:-./target/release/tpu-sync}
TRANSPORTS=("${@:-tcp tls quic}")
read -r -a TRANSPORTS <<<"${TRANSPORTS[*]}"
[[ $(id -u) -eq 0 ]] || { echo "SKIPPED: needs root (ip netns)"; exit 0; }
ip netns list >/dev/null 2>&1 || { echo "SKIPPED: ip netns unavailable"; exit 0; }
[[ -x $BIN ]] || cargo build --release --bin tpu-sync

ID=$$
NA=tsync-$ID-p NB=tsync-$ID-d VA=tsv${ID}a VB=tsv${ID}b
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  ip netns del "$NA" 2>/dev/null || true
  ip netns del "$NB" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

ip netns add "$NA"
ip netns add "$NB"
ip link add "$VA" type veth peer name "$VB"
ip link set "$VA" netns "$NA"
ip link set "$VB" netns "$NB"
ip -n "$NA" addr add 10.77.0.1/24 dev "$VA"
ip -n "$NB" addr add 10.77.0.2/24 dev "$VB"
ip -n "$NA" link set "$VA" up
ip -n "$NB" link set "$VB" up
echo "namespaces $NA (10.77.0.1) <-veth-> $NB (10.77.0.2)"

ARGS=(--layers "${LAYERS:-4}" --tokens "${TOKENS:-1024}")
for T in "${TRANSPORTS[@]}"; do
  CRED_P=() CRED_D=()
  if [[ $T != tcp ]]; then
    # 32 random bytes as a pre-shared key (both sides), see docs/network.md for CA certificates.
    head -c 32 /dev/urandom >"$WORK/psk"
    CRED_P=(--psk-file "$WORK/psk") CRED_D=(--psk-file "$WORK/psk")
  fi
  ip netns exec "$NA" "$BIN" prefill --listen 10.77.0.1:7700 --transport "$T" "${CRED_P[@]}" \
    "${ARGS[@]}" >"$WORK/prefill.out" 2>"$WORK/prefill.err" &
  PIDS+=($!)
  for _ in $(seq 100); do grep -q LISTENING "$WORK/prefill.out" 2>/dev/null && break; sleep 0.1; done
  ip netns exec "$NB" "$BIN" decode --connect 10.77.0.1:7700 --transport "$T" "${CRED_D[@]}" \
    "${ARGS[@]}" >"$WORK/decode.out" 2>"$WORK/decode.err"
  wait "${PIDS[-1]}"
  grep -o '"transport":"[^"]*"\|"net_bytes":[0-9]*\|"net_secs":[0-9.]*\|"mismatches":[0-9]*' \
    "$WORK/decode.out" | tr '\n' ' '
  echo " <- $T: prefill in $NA, decode in $NB"
done
echo "done; namespaces removed on exit"
