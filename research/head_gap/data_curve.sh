#!/bin/bash
# Issue 24: would more labelled data help the stop predictor? A learning curve on the demo pair.
#   research/head_gap/data_curve.sh       # resumable: data_gen resumes by shard, the probe reruns only if its report is missing
#   STAGES=3 research/head_gap/data_curve.sh   # also the next doubling (step 4: 920 responses)
# 1. data_gen with another seed over the same 230 bundled train prompts (192 tokens): new responses,
#    new candidates, the same prompt distribution -> data/demo/reference_seed1 (train split only);
# 2. the probe (research/head_gap/probe_features.py) on data/demo/reference plus it, fitting today's lag-free
#    features and the target@0 control on the first 1/8, 1/4, 1/2 and all of the 460 responses,
#    scored on the reference dev split and the held-out sets -> reports/probe_data_curve;
# Needs data/demo/reference, data/demo/heldout_{bundled,humaneval} and reports/bench/costs.json
# (research/head_gap/position_ablation.sh makes them).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: every path below is relative to it
PY=${PYTHON:-python}
T=${THREADS:-2}
export SPECDECPP_CACHE=${SPECDECPP_CACHE:-$PWD/.cache} HF_HUB_OFFLINE=1
$PY -m data_gen pair=demo prompts=bundled 'splits=[train]' 'limit={train: 230}' max_new_tokens=192 seed=1 \
    out=data/demo/reference_seed1 shard_size=32 num_threads=$T
test -f reports/probe_data_curve/probe.json || PROBE_THREADS=$T $PY research/head_gap/probe_features.py data/demo/reference \
    --extra-train data/demo/reference_seed1:train \
    --eval data/demo/heldout_bundled:test --eval data/demo/heldout_humaneval:test --costs reports/bench/costs.json \
    --sets "today's lag-free" "control" --train-fractions 0.125 0.25 0.5 1 --out reports/probe_data_curve
# 3. the real thing: a lag-free head (w_rej = 1, D = 1, target context, as research/head_gap/position_ablation.sh's
#    target_default head) trained on both datasets (train's data.path=[A,B]), then both heads scored
#    on the held-out prompts by infer.potential in the context they were trained in.
source research/head_gap/issue24_lib.sh
target_head heads/ablation/target_joined/next_wrej1_d1 data/demo/reference data/demo/reference_seed1
score_heads reports/data_curve heads/ablation/target_default/next_wrej1_d1 heads/ablation/target_joined/next_wrej1_d1
# 4. the next doubling (920 responses): data_gen seeds 2 and 3 over the same prompts, the probe on all four
#    seeds (half and all of them), and the same lag-free head trained on all four -> reports/probe_data_curve920,
#    heads/ablation/target_joined4, reports/data_curve920/{bundled,humaneval} (the three heads side by side).
#    `STAGES=2` (default) stops after step 3; `STAGES=3` runs this too.
[ "${STAGES:-2}" -ge 3 ] || exit 0
for s in 2 3; do
    $PY -m data_gen pair=demo prompts=bundled 'splits=[train]' 'limit={train: 230}' max_new_tokens=192 seed=$s \
        out=data/demo/reference_seed$s shard_size=32 num_threads=$T
done
test -f reports/probe_data_curve920/probe.json || PROBE_THREADS=$T $PY research/head_gap/probe_features.py data/demo/reference \
    --extra-train data/demo/reference_seed1:train --extra-train data/demo/reference_seed2:train \
    --extra-train data/demo/reference_seed3:train \
    --eval data/demo/heldout_bundled:test --eval data/demo/heldout_humaneval:test --costs reports/bench/costs.json \
    --sets "today's lag-free" "control" --train-fractions 0.5 1 --out reports/probe_data_curve920
target_head heads/ablation/target_joined4/next_wrej1_d1 data/demo/reference data/demo/reference_seed1 \
    data/demo/reference_seed2 data/demo/reference_seed3
score_heads reports/data_curve920 heads/ablation/target_default/next_wrej1_d1 \
    heads/ablation/target_joined/next_wrej1_d1 heads/ablation/target_joined4/next_wrej1_d1
# the curve of both probe runs as a table and a PNG (research/head_gap/learning_curve.png is a copy)
$PY research/head_gap/plot_learning_curve.py reports/probe_data_curve/probe.json reports/probe_data_curve920/probe.json \
    --out reports/data_curve/learning_curve.png
