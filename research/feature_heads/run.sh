#!/usr/bin/env bash
# Learned stopping on the feature pair (issue 62, item 4): label the feature draft at depths 1..4, train
# lag-free heads and the paper's heads on it, and ask the potential tool on held-out prompts (bundled test, HumanEval) how they
# compare with fixed K, SVIP and the perfect head. Resumable: each step is skipped once its output exists.
#   bash research/feature_heads/run.sh            (from the repository root; one thread, niced)
# Sizes: TRAIN=40 DEV=8 HELDOUT=20 prompts, TOKENS=96 (the demo's sizes; override in the environment).
set -euo pipefail
PY=${PYTHON:-python}
TRAIN=${TRAIN:-40}; DEV=${DEV:-8}; HELDOUT=${HELDOUT:-20}; TOKENS=${TOKENS:-96}
OUT=${OUT:-research/feature_heads/out}
export OMP_NUM_THREADS=1
mkdir -p "$OUT"
step() { echo "[$(date -u +%H:%M:%S)] $*"; }

[ -f data/demo_feature/bundled/meta.json ] && [ -f "$OUT/.data_done" ] || {
  step "data_gen: bundled train/dev"
  $PY -m data_gen pair=demo_feature prompts=bundled 'splits=[train,dev]' "limit={train: $TRAIN, dev: $DEV}" \
    max_new_tokens=$TOKENS out=data/demo_feature/bundled num_threads=1 && touch "$OUT/.data_done"; }
for set in bundled humaneval; do
  [ -f "$OUT/.heldout_$set" ] || {
    step "data_gen: held-out $set"
    if [ $set = bundled ]; then extra="'splits=[test]'"; else extra=""; fi
    eval $PY -m data_gen pair=demo_feature prompts=$set $extra "'limit={test: $HELDOUT}'" max_new_tokens=$TOKENS \
      out=data/demo_feature/heldout_$set num_threads=1 && touch "$OUT/.heldout_$set"; }
done
[ -f "$OUT/costs.json" ] || { step "costs (eager, one thread)"
  $PY -m infer.costs --pair demo_feature --limit 1 --max-new-tokens 16 --timing-steps 10 --threads 1 \
    --costs-out "$OUT/costs.json"; }
for h in next_wrej1_d0 next_wrej1_d1 next_wrej3_d1; do
  exp=${h#next_}
  [ -f "heads/demo_feature/$h/.done" ] || { step "train $h"
    $PY -m train "+experiment=[$exp,small_data]" pair=demo_feature data.path=data/demo_feature/bundled head=next \
      data.feature_context=target data.cache_features=true out=heads/demo_feature/$h trainer=cpu logger=none \
      && touch "heads/demo_feature/$h/.done"; }
done
for h in wrej1_d1 wrej6_d1; do  # the paper's head (one candidate of lag): the state after each candidate
  [ -f "heads/demo_feature/$h/.done" ] || { step "train $h (the paper's head)"
    $PY -m train "+experiment=[$h,small_data]" pair=demo_feature data.path=data/demo_feature/bundled head=resnet \
      data.feature_context=target data.cache_features=true out=heads/demo_feature/$h trainer=cpu logger=none \
      && touch "heads/demo_feature/$h/.done"; }
done
HEADS="--head heads/demo_feature/next_wrej1_d0 --head heads/demo_feature/next_wrej1_d1 --head heads/demo_feature/next_wrej3_d1"
HEADS="$HEADS --head heads/demo_feature/wrej1_d1 --head heads/demo_feature/wrej6_d1"
[ -f "$OUT/dev/potential.json" ] || { step "potential: dev (threshold choice)"
  $PY -m infer.potential data/demo_feature/bundled --split dev --costs "$OUT/costs.json" $HEADS --out "$OUT/dev"; }
for set in bundled humaneval; do
  [ -f "$OUT/$set/potential.json" ] || { step "potential: held-out $set"
    $PY -m infer.potential data/demo_feature/heldout_$set --split test --costs "$OUT/costs.json" $HEADS \
      --out "$OUT/$set"; }
done
step "done"
