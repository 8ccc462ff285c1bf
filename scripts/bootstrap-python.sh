#!/usr/bin/env bash
# Makes sure `python3 -m venv` works and creates the project's tool virtualenv .deps/tools (pip
# and uv), so no step installs into the system Python (Debian marks it externally managed, PEP
# 668). On Debian/Ubuntu without the venv module it installs python3-venv with apt (as root, or
# through sudo). Prints the tool venv's path. Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tools="$root/.deps/tools"
if [ -x "$tools/bin/uv" ]; then
  echo "$tools"
  exit 0
fi
py="$(command -v python3 || true)"
if [ -z "$py" ]; then
  echo "python3 not found: install Python 3.10+ (Debian/Ubuntu: apt-get install python3 python3-venv)" >&2
  exit 1
fi
probe="$(mktemp -d)"
trap 'rm -rf "$probe"' EXIT
if ! "$py" -m venv "$probe/v" >/dev/null 2>&1; then
  if command -v apt-get >/dev/null; then
    echo "python3 -m venv does not work; installing python3-venv with apt" >&2
    if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get install -y -q python3-venv >&2 ||
      { $sudo apt-get update -q >&2 && $sudo apt-get install -y -q python3-venv >&2; }
  else
    echo "python3 -m venv does not work and apt-get is not available: install the venv module" >&2
    exit 1
  fi
fi
rm -rf "$tools"
"$py" -m venv "$tools"
"$tools/bin/pip" install -q --disable-pip-version-check uv
echo "$tools"
