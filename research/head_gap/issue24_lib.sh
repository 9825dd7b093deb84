# Shared steps of research/head_gap/data_curve.sh and research/head_gap/domain_data.sh (source it; needs PY set).
# target_head OUT DATA...: the lag-free head of the issue-24 experiments (w_rej = 1, D = 1, the labels' own
#   context, lr 3e-3, batches of 8 prompts, 12 epochs, best-on-dev weights; research/head_gap/position_ablation.sh's
#   target_default recipe) trained on the datasets DATA joined (train's data.path=[A,B,...]) -> OUT, unless
#   OUT already holds one.
target_head() {
    local out=$1; shift
    local paths; paths=$(IFS=,; echo "$*")
    test -f "$out/model.safetensors" || $PY -m train +experiment=wrej1_d1 head=next pair=demo trainer=cpu logger=none \
        optimizer.lr=3e-3 data.batch_size=8 trainer.max_epochs=12 "data.path=[$paths]" data.feature_context=target \
        out="$out"
}
# score_heads REPORT HEAD...: infer.potential on the held-out bundled and HumanEval sets with the measured costs,
#   each lag-free head in the context it was trained in -> REPORT/{bundled,humaneval}, unless there already.
score_heads() {
    local report=$1; shift
    local heads=() h set
    for h in "$@"; do heads+=(--head "$h"); done
    for set in bundled humaneval; do
        test -f "$report/$set/potential.json" || $PY -m infer.potential data/demo/heldout_$set --split test \
            --costs reports/bench/costs.json --head-context target "${heads[@]}" --out "$report/$set"
    done
}
