#!/usr/bin/env bash
# Installs the XLA CPU PJRT plugin (PyPI package xla-cpu-pjrt) into the project-local .deps/.
# Idempotent: does nothing when the plugin is already there. Needs python3 (PyPI access); pip
# comes from the project's tool venv (scripts/bootstrap-python.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.deps/xla-cpu-pjrt"
so="$dest/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"
version="${XLA_CPU_PJRT_VERSION:-0.0.1}"
if [ -f "$so" ] && [ -f "$dest/xla_plugins/xla_cpu_pjrt/include/pjrt_c_api.h" ]; then
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "installing xla-cpu-pjrt==$version into $dest" >&2
"$("$root/scripts/bootstrap-python.sh")/bin/pip" download --disable-pip-version-check -q --no-deps --only-binary=:all: "xla-cpu-pjrt==$version" -d "$tmp"
rm -rf "$dest.partial"
mkdir -p "$dest.partial"
python3 -m zipfile -e "$tmp"/xla_cpu_pjrt-*.whl "$dest.partial"
rm -rf "$dest"
mv "$dest.partial" "$dest"
test -f "$so"
echo "PJRT plugin: $so" >&2
