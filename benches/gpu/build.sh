#!/usr/bin/env bash
# Builds the GPU check's copy program (benches/gpu/gpu_copy.rs) where cargo exists and puts a
# stripped copy at target/gpu/gpu_copy, the folder to carry to a machine without Rust:
#   bash benches/gpu/build.sh            # here
#   (device tool) run command="bash benches/gpu/run.sh" carry=["target/gpu"]
set -euo pipefail
cd "$(dirname "$0")/../.."
exe=$(cargo bench --bench gpu_copy --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_copy":
        print(m["executable"])')
[ -n "$exe" ] || { echo "build.sh: no gpu_copy executable built" >&2; exit 1; }
mkdir -p target/gpu
cp "$exe" target/gpu/gpu_copy
if command -v strip >/dev/null; then strip target/gpu/gpu_copy; fi
echo "built target/gpu/gpu_copy ($(du -h target/gpu/gpu_copy | cut -f1)) from $exe"
