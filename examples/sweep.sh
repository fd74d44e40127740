#!/usr/bin/env bash
# The reference sweep (docs/sweep/, regenerated with `bash examples/sweep.sh docs/sweep`; by default it
# writes to results/, which git ignores): the three models, every in-process strategy, 1/2/4 devices,
# 3 epochs on the embedded mnist-5k at global batch 64, each configuration in a fresh process with the
# parity checks on; then the report (summary.csv, summary.md, plots). An interrupted sweep resumes.
set -euo pipefail
results="${1:-results}"
cnnpar sweep --models 2+2,3+3,resnet --strategies single,mirrored,async-ps,layers,channels,hybrid --devices 1,2,4 \
  --epochs 3 --batch-size 64 --data mnist-5k --results "$results"
cnnpar report --results "$results"
