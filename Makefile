# make demo: the whole pipeline on the demo pair (docs/demo.md), CPU, no hub, about 20 minutes on 2 cores.
# make test: the test suite.
# Rerunning make demo resumes every stage; `make demo-clean` first to change sizes.
# Sizes are Hydra settings passed below; scale them on a bigger machine, e.g.
#   make demo DEMO_TRAIN_PROMPTS=230 DEMO_TEST_PROMPTS=70 DEMO_HUMANEVAL_PROMPTS=164 DEMO_TOKENS=256
PYTHON ?= python
export SPECDECPP_CACHE ?= $(CURDIR)/.cache
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline

DEMO_TRAIN_PROMPTS ?= 40      # bundled train prompts labelled by data_gen
DEMO_DEV_PROMPTS ?= 8         # bundled dev prompts (the head's validation set)
DEMO_LABEL_TOKENS ?= 96       # response length for data_gen
DEMO_TEST_PROMPTS ?= 6        # bundled test prompts decoded by every method
DEMO_HUMANEVAL_PROMPTS ?= 3   # HumanEval prompts decoded by every method
DEMO_TOKENS ?= 64             # max new tokens per decoded prompt
DEMO_THREADS ?= 1             # torch threads for infer (1: the target is overhead-bound at batch 1; 2 threads beside another job can run 25x slower)
DEMO_HEAD := heads/demo/wrej6_d3
DEMO_HEAD_PRESET ?= small_data  # the paper's lr 5e-5 x 3 epochs barely moves a head on a few thousand tokens (docs/train.md); DEMO_HEAD_PRESET=paper for the paper's settings on a full-size dataset

DEMO_COMPARISON := 'comparison.fixed_k.k=[1,2,3]' \
	'comparison.svip.threshold=[0.3,0.5]' \
	comparison.specdecpp.head=$(DEMO_HEAD) 'comparison.specdecpp.threshold=[0.3,0.5,0.7,0.9]' \
	'comparison.hf_assisted.mode=[heuristic,confidence]' comparison.hf_assisted.num_assistant_tokens=4 \
	'~comparison.oracle'

.PHONY: install demo-pair demo-data demo-head demo-infer demo-report demo demo-clean test

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[dev]"

demo-pair:  # fetch and dequantise the target, materialise the shipped draft
	$(PYTHON) -m specdecpp.demo

demo-data: demo-pair
	$(PYTHON) -m data_gen pair=demo prompts=bundled 'splits=[train,dev]' \
		'limit={train: $(strip $(DEMO_TRAIN_PROMPTS)), dev: $(strip $(DEMO_DEV_PROMPTS))}' \
		max_new_tokens=$(strip $(DEMO_LABEL_TOKENS))

demo-head: demo-data
	$(PYTHON) -m train '+experiment=[wrej6_d3,$(strip $(DEMO_HEAD_PRESET))]' pair=demo data.path=data/demo/bundled out=$(DEMO_HEAD) \
		trainer=cpu logger=none

demo-infer: demo-head
	$(PYTHON) -m infer.sweep pair=demo prompts=bundled prompts.limit=$(strip $(DEMO_TEST_PROMPTS)) \
		max_new_tokens=$(strip $(DEMO_TOKENS)) num_threads=$(strip $(DEMO_THREADS)) $(DEMO_COMPARISON)
	$(PYTHON) -m infer.sweep pair=demo prompts=humaneval prompts.limit=$(strip $(DEMO_HUMANEVAL_PROMPTS)) \
		max_new_tokens=$(strip $(DEMO_TOKENS)) num_threads=$(strip $(DEMO_THREADS)) $(DEMO_COMPARISON)

demo-report: demo-infer
	$(PYTHON) -m infer.report results/demo --out reports/demo

demo: install
	@start=$$(date +%s); $(MAKE) --no-print-directory demo-report && \
		echo "make demo: $$(( $$(date +%s) - start )) s; report in reports/demo/"

demo-clean:  # forget the demo's products (data_gen refuses changed sizes over an existing dataset)
	rm -rf data/demo heads/demo results/demo reports/demo

test: install
	$(PYTHON) -m pytest
