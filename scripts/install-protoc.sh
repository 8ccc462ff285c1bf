#!/usr/bin/env bash
# Installs protoc (Debian's `protobuf-compiler`) and protobuf's well-known .proto files
# (`libprotobuf-dev`, /usr/include/google/protobuf/*.proto): the `etcd-client` crate used by
# tpu_sync::cluster generates its gRPC code from etcd's .proto files at build time
# (tonic-prost-build), which needs both. Idempotent; root or sudo.
set -euo pipefail
if { command -v protoc >/dev/null 2>&1 && [ -f /usr/include/google/protobuf/descriptor.proto ]; } \
   || [ -n "${PROTOC:-}" ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q --no-install-recommends protobuf-compiler libprotobuf-dev >/dev/null 2>&1 || {
  $sudo apt-get update -q >/dev/null
  $sudo apt-get install -y -q --no-install-recommends protobuf-compiler libprotobuf-dev >/dev/null
}
command -v protoc >/dev/null || { echo "protobuf-compiler installed but no protoc on PATH" >&2; exit 1; }
