#!/usr/bin/env bash
# Builds what gpu_check.sh runs, for a GPU machine without a Rust toolchain or network: the
# release `shoal` binary and the CUDA and wgpu test executables of shoal-compute, stripped,
# into DIR. Then, on the GPU machine (same architecture, glibc as new or newer):
#
#   compute/benches/gpu_prebuild.sh DIR        # here
#   GPU_CHECK_PREBUILT=DIR compute/benches/gpu_check.sh   # there, in a copy of this tree
set -euo pipefail
dir=${1:?usage: gpu_prebuild.sh DIR}
cd "$(dirname "$0")/../.."
mkdir -p "$dir"
cargo build --release -p shoal-node
install -m 755 target/release/shoal "$dir/shoal"
# The test executables' paths come from cargo's JSON messages.
cargo test --release -p shoal-compute --test cuda --test wgpu --no-run --message-format=json |
  python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("cuda", "wgpu"):
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"] + "-tests")
' "$dir"
for b in shoal cuda-tests wgpu-tests; do
  [ -x "$dir/$b" ] || { echo "gpu_prebuild.sh: $dir/$b was not built" >&2; exit 1; }
  strip "$dir/$b" 2>/dev/null || true
done
ls -l "$dir"
