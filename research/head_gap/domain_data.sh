#!/bin/bash
# Issue 24: does in-domain labelled data help the stop predictor more than the same amount of other data?
#   research/head_gap/domain_data.sh      # resumable (data_gen by shard; the probe reruns only if its report is missing)
# 1. HumanEval problems 100-163 (never in a held-out set: make potential uses 0-39, make bench-heads 0-79) as a
#    `jsonl` prompt file with split train -> data/prompts/humaneval_100_163.jsonl; data_gen labels them as the
#    reference data was labelled (192 tokens, seed 0) -> data/demo/humaneval_train (64 responses);
# 2. the probe on the reference data plus those 64 responses, beside the reference data plus the first 64
#    responses of data/demo/reference_seed1 (bundled prompts, the same amount) -> reports/probe_domain/{code,bundled}.
# 3. a real lag-free head on the reference data plus the code responses, scored by infer.potential (below).
# Needs data/demo/reference, data/demo/reference_seed1 (research/head_gap/data_curve.sh), the held-out sets and
# reports/bench/costs.json (research/head_gap/position_ablation.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: every path below is relative to it
PY=${PYTHON:-python}
T=${THREADS:-1}
export SPECDECPP_CACHE=${SPECDECPP_CACHE:-$PWD/.cache} HF_HUB_OFFLINE=1
mkdir -p data/prompts
test -f data/prompts/humaneval_100_163.jsonl || $PY - <<'PY'
import json
from specdecpp.data.prompts import load_prompts
rows = [{"id": p.id, "prompt": p.prompt, "split": "train"} for p in load_prompts("humaneval", split="test")[100:164]]
with open("data/prompts/humaneval_100_163.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
PY
$PY -m data_gen pair=demo prompts=jsonl prompts.path=data/prompts/humaneval_100_163.jsonl prompts.name=humaneval_train \
    'splits=[train]' max_new_tokens=192 seed=0 out=data/demo/humaneval_train shard_size=32 num_threads=$T
common=(data/demo/reference --eval data/demo/heldout_bundled:test --eval data/demo/heldout_humaneval:test
        --costs reports/bench/costs.json --sets "today's lag-free" "control")
# 2 and 2b: the two probes with training seeds 0, 1 and 2 (a probe's margin moves by 0.3-0.4 points between seeds)
#    -> reports/probe_domain/{code,bundled} (seed 0) and {code,bundled}_seed{1,2}; feature blocks kept in
#    .cache/probe_blocks.
for seed in 0 1 2; do
    for kind in code bundled; do
        extra=data/demo/humaneval_train:train
        [ $kind = code ] || extra=data/demo/reference_seed1:train:64
        out=reports/probe_domain/$kind
        [ $seed = 0 ] || out=${out}_seed$seed
        test -f $out/probe.json || PROBE_THREADS=$T $PY research/head_gap/probe_features.py "${common[@]}" --extra-train $extra \
            --seed $seed --cache .cache/probe_blocks --out $out
    done
done
# 3. the real thing: the lag-free head of research/head_gap/data_curve.sh's step 3 (w_rej = 1, D = 1, target context) trained
#    on the reference data plus the 64 code responses, scored beside the reference-only head on the held-out sets
#    (HumanEval problems 0-39 and the bundled test prompts) -> reports/domain_data/{bundled,humaneval}.
source research/head_gap/issue24_lib.sh
target_head heads/ablation/target_code/next_wrej1_d1 data/demo/reference data/demo/humaneval_train
score_heads reports/domain_data heads/ablation/target_default/next_wrej1_d1 heads/ablation/target_code/next_wrej1_d1
