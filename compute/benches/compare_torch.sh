#!/usr/bin/env bash
# Compares shoal's CPU training step with PyTorch eager on the same machine, in one run:
# the two benchmarks alternate for a few rounds (so background load hits both alike) and the
# ratio of the medians of their step-time medians is printed.
#
#   pip install torch            # once
#   cargo build --release -p shoal-node
#   compute/benches/compare_torch.sh [PRESET] [BATCH] [THREADS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
preset=${1:-micro} batch=${2:-8} threads=${3:-2} rounds=${4:-3}
shoal=target/release/shoal
[ -x "$shoal" ] || cargo build --release -p shoal-node
for _ in $(seq "$rounds"); do
  "$shoal" bench compute --preset "$preset" --batch "$batch" --threads "$threads" --steps 20 --json
  python3 compute/benches/torch_reference.py --preset "$preset" --batch "$batch" --threads "$threads" --steps 20 --json
done | python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
shoal = [r["step_ms_median"] for r in rows if r.get("framework") != "pytorch"]
torch = [r["step_ms_median"] for r in rows if r.get("framework") == "pytorch"]
s, t = statistics.median(shoal), statistics.median(torch)
ver = next(r["torch_version"] for r in rows if r.get("framework") == "pytorch")
print(json.dumps({"shoal_step_ms": round(s, 2), "pytorch_step_ms": round(t, 2),
                  "ratio": round(s / t, 3), "torch_version": ver,
                  "shoal_rounds": shoal, "pytorch_rounds": torch}))
'
