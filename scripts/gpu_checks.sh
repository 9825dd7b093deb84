#!/usr/bin/env bash
# The checks a lent CUDA machine runs (docs/gpu.md): scripts/gpu_checks.sh STAGE [STAGE ...]
#   setup    install carried wheels (.whl/*.whl, for an image without hydra/datasets/gguf) and this repo
#   tests    pytest -m gpu: the CUDA twins of every exactness test (chain, tree, batch, PEARL, cascades)
#   core     the quick part of them first: every decoder's greedy equality and same-seed test, the T=1
#            chi-square of every non-batch decoder, the attention-kernel test (no `slow` ones), eager and
#            fast="graphs" (the fast_static variants run on CUDA in `tests`; fast-units tests the static runners), and
#            the host reads of a round (tests/decoders/test_host_reads.py)
#   pair     materialise the demo pair from a local GGUF ($GGUF, or the parts $GGUF_PARTS/part* joined)
#   demo     make demo's stages on CUDA (data_gen, the head on the GPU, costs, potential, infer, report)
#   bench    the benchmark on CUDA at a reduced size: costs, Sequoia's tree, every method, report
#   pearl    PEARL (draft and target on two CUDA streams) against target-only and fixed K
#   batch    batches of 1, 4, 16 on CUDA
#   fast     the fast path (docs/engine.md), within 8 minutes and without the GGUF: first scripts/bench_fast.py
#            --random (the demo configs, random weights) with fast=graphs (CUDA graphs, captured per bucket on first
#            use: no compiling): t_target(1, 2, 4, 8) and t_draft eager against graphs, the weight-read floor,
#            target-only / fixed K 1-3 / SVIP eager against graphs, greedy equality and the capture time (at most
#            2 min; JSON in $LOGS/bench_fast_graphs_cuda.json); then the CUDA twins of the fast exactness tests
#            (batches too), of the static runners' and of the graphs backend's (pytest -m gpu -k "fast or
#            static_runner or static_batch or graphs": fast_static, fast_graphs and, compiled on tiny models,
#            fast_compile; at most 3 min); then the same benchmark with fast=compile (eager against compiled and the
#            compile time; at most 3 min; JSON in $LOGS/bench_fast_cuda.json). (--random has no trained head: a
#            head's eager/fast run needs the demo pair, `bench_fast.py --head DIR --fast graphs` after `pair`.)
#            Its parts run alone as stages fast-graphs, fast-units (FAST_TEST_FILES narrows it) and fast-compile.
#   fast-compile-graphs  fast="compile-graphs" (each bucket compiled by inductor, then captured): its CUDA tests
#            (test_graphs.py's, and the greedy and same-seed exactness twins), then scripts/bench_fast.py --random
#            --fast compile-graphs (JSON in $LOGS/bench_fast_compile_graphs_cuda.json); each at most 4 min
#   rounds   captured rounds (a fixed-K or target-only round as one CUDA graph, specdecpp/decoders/captured.py): their
#            CUDA tests with the host reads and the graphs twins of target-only and fixed K, then scripts/bench_fast.py
#            --random on $ROUNDS_BACKEND (graphs) greedy and sampled ($ROUNDS_SAMPLINGS), $ROUNDS_PROMPTS (8) prompts,
#            eager, rounds captured and per forward in one interleaved pass (--also-per-forward: captured over
#            per-forward with a paired interval), then --round-graphs (each round graph against a graph of its
#            forwards alone, the loop's share); JSON in $LOGS/bench_rounds_*_cuda.json. ROUNDS_FUSED=1 (with
#            ROUNDS_BACKEND=compile-graphs): the rounds' work between forwards compiled too (--fused-rounds)
#   lease    setup, then core (12 workers, CORE_TIMEOUT 290 s) and rounds-tests (4 workers, 240 s) side by side, every
#            test's result named in $LOGS/core.log and rounds-tests.log: about 5 minutes, the first call of a 15-minute
#            lease (docs/gpu.md, "What the next lent GPU should run")
#   rounds-tests  the `rounds` stage's tests alone
#   fast-pair  after `pair`: scripts/bench_fast.py on the demo pair with the shipped head (demo/heads/next_wrej1_d1),
#            eager against fast=graphs (FAST_PAIR_BACKEND), greedy then sampled (temperature 1, top-k 50), with
#            --breakdown (the loop's share of a round, from a second, metered pass); JSON in $LOGS/bench_fast_pair_{greedy,paper}_cuda.json.
#            FAST_PAIR_SAMPLINGS narrows the samplings; FAST_PAIR_FUSED=1 (with FAST_PAIR_BACKEND=compile-graphs): fused
#            rounds against plain captured ones in the same pass (--fused-rounds --also-unfused)
# Every stage writes its log to $LOGS (default reports/gpu) and resumes where an earlier call stopped.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${LOGS:-${OUT:-reports/gpu}}  # the device tool's $OUT where set: the logs come back even when a call is cut off
STAGE_TIMEOUT=${STAGE_TIMEOUT:-0}  # seconds per stage (0: none), so that one slow stage leaves time for the next
export SPECDECPP_CACHE=${SPECDECPP_CACHE:-$HOME/.cache/specdecpp} HF_HUB_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # where setup puts carried wheels
mkdir -p "$LOGS"

run() {  # run NAME CMD...: log to $LOGS/NAME.log, report the exit status
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$STAGE_TIMEOUT" "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    return "$rc"
}

xdist_args() {  # workers=(...): pytest-xdist's where installed, stealing work (xdist >= 3.2) so a slow test's tail is shared
    workers=()
    $PY -c "import xdist" 2>/dev/null || return 0
    workers=(-n "${TEST_WORKERS:-16}")
    if $PY -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" 2>/dev/null; then
        workers+=(--dist worksteal)
    fi
}

for stage in "$@"; do
    case $stage in
    setup)
        if ! $PY -c "import hydra, datasets, gguf" 2>/dev/null; then
            $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
        fi
        $PY -c "import datasets, hydra, gguf; print('datasets', datasets.__version__, 'hydra', hydra.__version__)" || exit 1
        $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed: using PYTHONPATH"
        command -v make >/dev/null || echo "no make on this machine"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
        ;;
    tests)
        xdist_args  # the twins took over 12 minutes on an H100 with 16 workers
        run tests $PY -m pytest -m gpu -q -p no:cacheprovider "${workers[@]}" --durations=10 tests ;;
    core)
        xdist_args
        run core $PY -m pytest -m "gpu and not slow" -k "(greedy or same_seed or T1 or attention) and not fast_static" -q \
            -p no:cacheprovider "${workers[@]}" --durations=10 tests/decoders/test_exactness.py tests/core/test_attention.py \
            tests/decoders/test_host_reads.py ;;
    pair)
        if [ -n "${GGUF_PARTS:-}" ]; then
            GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
            cat "$GGUF_PARTS"/part* > "$GGUF"
        fi
        run pair $PY -m specdecpp_demo ${GGUF:+--gguf "$GGUF"} ;;
    demo)
        run demo make --no-print-directory demo-report PYTHON="$PY" DEMO_TRAINER=gpu ;;
    bench)
        run bench make --no-print-directory bench-report PYTHON="$PY" BENCH_PROMPTS="${BENCH_PROMPTS:-6}" ;;
    pearl)
        run pearl $PY scripts/bench_pearl.py --prompts "${PEARL_PROMPTS:-4}" --max-new-tokens 64 --overlap \
            --svip-gamma 4 --out reports/pearl/bench_cuda.json ;;
    batch)
        run batch $PY scripts/bench_batch.py --prompts "${BATCH_PROMPTS:-16}" --max-new-tokens 48 --batch-sizes 1 4 16 \
            --fixed-k 1 2 --fill --repeats 1 --timing-steps 10 --out reports/batch/bench_cuda.json ;;
    lease)  # the first call of a lease (docs/gpu.md's list): setup, then core and rounds-tests side by side (~5 min)
        bash "$0" setup || exit 1
        export PYTEST_ADDOPTS=${PYTEST_ADDOPTS:-"-vv -rf"}  # each test's result in the log, even if a timeout cuts it
        TEST_WORKERS=${ROUNDS_TEST_WORKERS:-4} STAGE_TIMEOUT=${ROUNDS_TESTS_TIMEOUT:-240} bash "$0" rounds-tests \
            > "$LOGS/rounds-tests.out" 2>&1 &
        TEST_WORKERS=${CORE_TEST_WORKERS:-12} STAGE_TIMEOUT=${CORE_TIMEOUT:-290} bash "$0" core
        wait
        tail -n 25 "$LOGS/rounds-tests.out" ;;
    fast)  # the three parts below, in this order
        bash "$0" fast-graphs fast-units fast-compile ;;
    fast-graphs)
        STAGE_TIMEOUT=${FAST_GRAPHS_TIMEOUT:-120} run fast-bench-graphs $PY scripts/bench_fast.py --random --device cuda \
            --fast graphs --prompts "${FAST_PROMPTS:-4}" --max-new-tokens 48 --svip-max 3 --repeats 20 \
            --out "$LOGS/bench_fast_graphs_cuda.json" ;;
    fast-units)  # the runners' CUDA twins; the fast decoders' greedy/same-seed/T1 twins are in `core`
        xdist_args
        STAGE_TIMEOUT=${FAST_TESTS_TIMEOUT:-180} run fast-tests $PY -m pytest -m gpu \
            -k "(fast or static_runner or static_batch or graphs or compile_options) and not compile-graphs and not compile_graphs" -q \
            -p no:cacheprovider "${workers[@]}" --durations=10 \
            ${FAST_TEST_FILES:-tests/decoders/test_exactness.py tests/models/test_static_runner.py \
            tests/models/test_static_batch_runner.py tests/models/test_graphs.py tests/decoders/test_fast_decoders.py \
            tests/models/test_compile_options.py} ;;
    fast-compile)
        STAGE_TIMEOUT=${FAST_BENCH_TIMEOUT:-180} run fast-bench $PY scripts/bench_fast.py --random --device cuda \
            --fast compile --prompts "${FAST_PROMPTS:-4}" --max-new-tokens 48 --svip-max 3 --repeats 20 \
            --out "$LOGS/bench_fast_cuda.json" ;;
    fast-compile-graphs)
        xdist_args
        STAGE_TIMEOUT=${FAST_CG_TESTS_TIMEOUT:-240} run fast-compile-graphs-tests $PY -m pytest -m gpu -q \
            -k "compile_graphs or (compile-graphs and (greedy or same_seed))" -p no:cacheprovider "${workers[@]}" \
            --durations=10 tests/models/test_graphs.py tests/decoders/test_exactness.py
        STAGE_TIMEOUT=${FAST_CG_BENCH_TIMEOUT:-240} run fast-bench-compile-graphs $PY scripts/bench_fast.py --random \
            --device cuda --fast compile-graphs --prompts "${FAST_PROMPTS:-4}" --max-new-tokens 48 --svip-max 3 \
            --repeats 20 --out "$LOGS/bench_fast_compile_graphs_cuda.json" ;;
    rounds-tests)  # captured rounds' CUDA tests (fused ones too), the host reads, the graphs twins of target-only and fixed K
        xdist_args
        STAGE_TIMEOUT=${ROUNDS_TESTS_TIMEOUT:-150} run rounds-tests $PY -m pytest -m gpu -q -rf -p no:cacheprovider \
            "${workers[@]}" --durations=10 tests/decoders/test_captured_rounds.py tests/decoders/test_host_reads.py \
            tests/models/test_graphs.py tests/decoders/test_exactness.py \
            -k "(captured or replay or reads or fused or test_graphs or ((chain-target_only-fast_graphs or chain-fixed_k3-fast_graphs) and (greedy or same_seed or T1)))" ;;
    rounds)  # captured rounds (specdecpp/decoders/captured.py): their CUDA tests, then each round as one graph against per forward
        bash "$0" rounds-tests
        for sampling in ${ROUNDS_SAMPLINGS:-greedy paper}; do  # captured and per-forward interleaved in one pass
            STAGE_TIMEOUT=${ROUNDS_BENCH_TIMEOUT:-200} run "rounds-bench-$sampling${ROUNDS_FUSED:+-fused}" $PY \
                scripts/bench_fast.py --random --device cuda --fast "${ROUNDS_BACKEND:-graphs}" \
                --prompts "${ROUNDS_PROMPTS:-8}" --max-new-tokens 64 --svip-max 3 --repeats 20 --sampling "$sampling" \
                --also-per-forward --round-graphs ${ROUNDS_FUSED:+--fused-rounds --also-unfused} \
                --out "$LOGS/bench_rounds_${ROUNDS_BACKEND:-graphs}_${sampling}${ROUNDS_FUSED:+_fused}_cuda.json"
        done ;;
    fast-pair)  # after `pair`: the fast path on the demo pair with its head, greedy then sampled, with the loop's share
        for sampling in ${FAST_PAIR_SAMPLINGS:-greedy paper}; do
            STAGE_TIMEOUT=${FAST_PAIR_TIMEOUT:-280} run "fast-pair-$sampling${FAST_PAIR_FUSED:+-fused}" $PY \
                scripts/bench_fast.py --device cuda --fast "${FAST_PAIR_BACKEND:-graphs}" \
                --head demo/heads/next_wrej1_d1 --prompts "${FAST_PROMPTS:-4}" \
                --max-new-tokens 64 --repeats 20 --sampling "$sampling" --breakdown \
                ${FAST_PAIR_FUSED:+--fused-rounds --also-unfused} \
                --out "$LOGS/bench_fast_pair_${sampling}${FAST_PAIR_FUSED:+_fused}_cuda.json"
        done ;;
    *)
        echo "unknown stage $stage" >&2; exit 2 ;;
    esac
done
