#!/usr/bin/env bash
# Issue 24: does the candidate's position in the response help a lag-free head? (research/head_gap/README.md)
# Resumable: every step skips what is already there; rerun after an interruption.
#   research/head_gap/position_ablation.sh            # data (reference + held-out), costs, heads, potential, probe
# THREADS=1 while another benchmark runs beside it.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
PY=${PYTHON:-python}
T=${THREADS:-2}
export SPECDECPP_CACHE=${SPECDECPP_CACHE:-$PWD/.cache} HF_HUB_OFFLINE=1
# the reference heads' data (python -m specdecpp_demo.reference_heads --stage data) and make potential's held-out sets
$PY -m data_gen pair=demo prompts=bundled 'splits=[train,dev]' 'limit={train: 230, dev: 30}' max_new_tokens=192 \
    out=data/demo/reference shard_size=32 num_threads=$T
$PY -m data_gen pair=demo prompts=bundled 'splits=[test]' 'limit={test: 40}' max_new_tokens=96 \
    out=data/demo/heldout_bundled num_threads=$T
$PY -m data_gen pair=demo prompts=humaneval 'limit={test: 40}' max_new_tokens=96 out=data/demo/heldout_humaneval \
    num_threads=$T
test -f reports/bench/costs.json || $PY -m infer.costs --limit 10 --max-new-tokens 96 --timing-steps 60 \
    --max-width 16 --out reports/bench/pair.json --costs-out reports/bench/costs.json
common="head=next pair=demo data.path=data/demo/reference trainer=cpu logger=none optimizer.lr=3e-3 data.batch_size=8 trainer.max_epochs=12"
five="hidden,embedding,prob,logprob,entropy"
train() {  # train OUT OVERRIDES...: skip a head already trained
    local out=$1; shift
    test -f "$out/model.safetensors" || $PY -m train +experiment=wrej1_d1 $common "$@" out="$out"
}
train heads/ablation/mixed_default/next_wrej1_d1
train heads/ablation/target_default/next_wrej1_d1 data.feature_context=target
train heads/ablation/target_position/next_wrej1_d1 data.feature_context=target "head.features=[$five,position]"
train heads/ablation/mixed_position/next_wrej1_d1 "head.features=[$five,position]"
for set in bundled humaneval; do
    for ctx in target mixed; do
        heads=(--head demo/heads/next_wrej1_d1)
        if [ $ctx = target ]; then
            heads+=(--head heads/ablation/target_default/next_wrej1_d1 --head heads/ablation/target_position/next_wrej1_d1)
        else
            heads+=(--head heads/ablation/mixed_default/next_wrej1_d1 --head heads/ablation/mixed_position/next_wrej1_d1)
        fi
        test -f reports/ablation_position/$set-$ctx/potential.json || $PY -m infer.potential data/demo/heldout_$set \
            --split test --costs reports/bench/costs.json --head-context $ctx "${heads[@]}" \
            --out reports/ablation_position/$set-$ctx
    done
done
$PY research/head_gap/ablation_table.py heads/ablation/*/* > reports/ablation_position/dev_table.md
test -f reports/probe_position/probe.json || $PY research/head_gap/probe_features.py data/demo/reference \
    --eval data/demo/heldout_bundled:test --eval data/demo/heldout_humaneval:test --costs reports/bench/costs.json \
    --sets "q numbers (" "q numbers + position" "today's lag-free" "today's + topm + position" --out reports/probe_position
echo "position ablation: done"
