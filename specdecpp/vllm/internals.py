"""Every vLLM internal that specdecpp touches, in one module (vLLM 0.32; tests/vllm/test_vllm_internals.py
and, for the EAGLE proposer, tests/vllm/test_vllm_feature_draft.py fail loudly when one changes shape).

What is touched, and why:

1. ``vllm.v1.spec_decode.draft_model.DraftModelProposer`` is subclassed (:func:`proposer_class`):
   its draft loop (``SpecDecodeBaseProposer.propose``) samples every pass's candidates through
   ``_sample_draft_tokens(hidden_states, sampling_metadata)``, which sees the draft's final hidden
   state of every drafted position. The subclass computes the logits there, samples with
   ``_sample_from_logits`` as vLLM does, asks the stop policy which rows stop
   (:class:`~specdecpp.vllm.drafts.StoppedDrafts`), leaves the loop once every row has stopped,
   and returns one list per request of its own length (the runner takes lists as it does from
   ngram; ``_last_draft_probs`` carries the distributions to the rejection sampler).
   The same subclass of ``vllm.v1.spec_decode.eagle.EagleProposer`` (``proposer_class("eagle3")``;
   it adds nothing to that loop but passing the target's hidden states to the draft) stops a
   feature draft's (EAGLE-3) requests; the draft's logits come from ``Eagle3LlamaForCausalLM.
   compute_logits`` (its draft vocabulary scattered into the target's through ``d2t``, -inf elsewhere,
   as ``FeatureDraft.full_logits``), and the state handed to ``_sample_draft_tokens`` is the model's
   first output, ``last_hidden_states``: the final-normed state (its second, fed back, is that state
   only with ``norm_output``). A lag-free head therefore reads exactly ``FeatureDraftOutput.hidden``
   and the logits the library's engine hands it; a head with a ``norm_output=false`` draft is
   refused (by ``speculative_config`` and again here).
2. ``vllm.v1.worker.gpu_model_runner.DraftModelProposer`` and ``.EagleProposer``, the names the model
   runner (the CPU runner is its subclass) builds its draft proposer from, are rebound to the
   subclasses (:func:`install_proposer`). Without a policy bundle a subclass is vLLM's own proposer.
   The runner also asserts ``isinstance(drafter, EagleProposer)`` by that name, which vLLM's other
   subclass of it (``Step3p5MTPProposer``, built by its own name) must still pass: the EAGLE
   subclass's metaclass answers ``isinstance`` for ``EagleProposer`` itself.
3. ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, the CPU stand-in of the rejection
   sampler's ``expand_kernel``, converts its float output to an int64 copy and never writes the
   real output back: per-token temperature, top-k and top-p are uninitialised memory in sampled
   speculative decoding (docs/vllm.md). Where the bug is present (:func:`expand_bug_present`), it
   is replaced by a ``repeat_interleave`` (:func:`expand_kernel_impl`) before the CPU platform
   registers its kernels; ``SPECDECPP_VLLM_KEEP_CPU_EXPAND=1`` keeps vLLM's.
4. ``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_only``, the top-k path of the sampler on a
   CPU, calls ``k.max()``, which raises on an empty batch; the rejection sampler hands it one when
   no request of a step has a draft token left (each request's last token, e.g. ``max_tokens``
   reached). Where that raises (:func:`top_k_bug_present`), it is wrapped to return the empty
   logits as they are (:func:`install_top_k_fix`); ``SPECDECPP_VLLM_KEEP_CPU_TOP_K=1`` keeps vLLM's.
5. Load-aware lengths and the online estimator (docs/vllm.md, "Load-aware lengths"): the subclass
   also overrides ``prepare_next_token_ids_cpu`` / ``prepare_next_token_ids_padded`` (the runner calls
   one with the step's sampled tokens before ``propose``; their valid counts are each request's
   accepted + 1, by ``gpu_input_batch.req_ids``) to feed the online acceptance estimator, reads
   ``runner.input_batch.req_ids`` after ``propose``, and, to measure the step costs at start-up
   (``load_aware=True``), times ``runner._dummy_run(n, is_profile=True)`` (the target over n tokens)
   and the proposer's own ``dummy_run(b)`` (its passes over b rows) at the end of ``load_model``. With an
   EAGLE-3 draft the runner sets the target's aux hidden-state layers only after the drafter's
   ``load_model``, and its dummy run then fails to unpack the target's outputs, so the proposer calls
   ``runner._setup_eagle3_aux_hidden_state_outputs()`` (idempotent: it sets the layer ids) before
   measuring, where ``runner.use_aux_hidden_state_outputs`` is set.

:func:`register` is the ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls it in
every process before it builds a model runner.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .config import read_load_aware, read_policy
from .drafts import LoadAware, Outcomes, StoppedDrafts
from .load_aware import StepCosts, measure_step_costs
from .version import SUPPORTED_BELOW, SUPPORTED_MIN, check_version, installed_version, release

logger = logging.getLogger("specdecpp.vllm")
KEEP_EXPAND_ENV = "SPECDECPP_VLLM_KEEP_CPU_EXPAND"
KEEP_TOP_K_ENV = "SPECDECPP_VLLM_KEEP_CPU_TOP_K"
REPLACED: dict[str, object] = {}  # vLLM's functions this process replaced, by fix ("expand", "top_k")


class AllStopped(Exception):
    """Raised inside vLLM's draft loop once every request has stopped: it ends the loop early."""


class DraftView:
    """What a stop policy's ``bind`` (a head's ``attach``) reads of a draft, from vLLM's draft model:
    its Hugging Face ``config``, its ``device`` and its input embedding."""

    def __init__(self, model: torch.nn.Module, hf_config) -> None:
        self.config = hf_config
        self.device = next(model.parameters()).device
        self._embedding = TokenEmbedding(model)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self._embedding

    def get_output_embeddings(self):
        return None  # vLLM's draft scores its whole vocabulary (it ignores specdecpp_output_vocab.json)


class TokenEmbedding(torch.nn.Module):
    """A vLLM model's ``embed_input_ids`` as a module with a ``weight`` (the lag-free head's feature)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["_model"] = model
        self.weight = next(model.parameters())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.__dict__["_model"].embed_input_ids(ids)


def temperature_of(sampling_metadata) -> float:
    """The one temperature a policy is bound to for this pass: 0 when every request is greedy,
    else the first request's (vLLM's per-request temperatures; greedy rows are 0)."""
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return 0.0
    return float(sampling_metadata.temperature[0])


# The proposers that take a bundle's stop policy: vLLM's class for each, by the method that builds it.
PROPOSER_BASES = {"draft_model": ("vllm.v1.spec_decode.draft_model", "DraftModelProposer"),
                  "eagle3": ("vllm.v1.spec_decode.eagle", "EagleProposer")}


class _CoversBase(type):
    """The metaclass of the EAGLE subclass: ``isinstance(x, subclass)`` is ``isinstance(x, EagleProposer)``,
    so the runner's checks against the name it rebinds still pass for vLLM's other subclasses of
    ``EagleProposer`` (``Step3p5MTPProposer``), which are built under their own names."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls.__mro__[1])


def proposer_class(method: str = "draft_model") -> type:
    """vLLM's proposer of ``method`` (``"draft_model"``: ``DraftModelProposer``; ``"eagle3"``:
    ``EagleProposer``, which drafts with a feature draft) with each request's draft stopped by the
    bundle's stop policy. Both run ``SpecDecodeBaseProposer.propose``'s loop, sampling every pass
    through ``_sample_draft_tokens``, which the subclass overrides. One class per method."""
    return _proposer_class(method)


@functools.cache
def _proposer_class(method: str) -> type:
    import importlib

    if method not in PROPOSER_BASES:
        raise ValueError(f"no stop-policy proposer for vLLM method {method!r}: one of {sorted(PROPOSER_BASES)}")
    module, name = PROPOSER_BASES[method]
    base = getattr(importlib.import_module(module), name)
    meta = _CoversBase if method == "eagle3" else type

    class StopPolicyProposer(base, metaclass=meta):
        """vLLM's proposer that stops each request's draft by a specdecpp stop policy."""

        def __init__(self, vllm_config, device, runner=None) -> None:
            super().__init__(vllm_config=vllm_config, device=device, runner=runner)
            self.stop_policy = read_policy(self.speculative_config.draft_model_config.model)
            self._drafts: StoppedDrafts | None = None
            self._bound_temperature: float | None = None
            if self.stop_policy is None:
                return
            check_version()
            if runner is not None and getattr(runner, "use_async_scheduling", False):
                raise ValueError("specdecpp's stop policies hand vLLM one draft list per request, which async "
                                 "scheduling does not take: start vLLM with async_scheduling=False")
            if self.use_heterogeneous_vocab or self.parallel_drafting or self.use_local_argmax_reduction:
                raise ValueError("specdecpp's stop policies run with a draft of the target's vocabulary, drafting "
                                 "one token per pass: unset use_heterogeneous_vocab, parallel_drafting and "
                                 "use_local_argmax_reduction")
            draft_config = self.speculative_config.draft_model_config.hf_config
            if (self.method == "eagle3" and getattr(self.stop_policy, "head", None) is not None
                    and not getattr(draft_config, "norm_output", False)):
                raise ValueError("a head with a feature draft of norm_output=false: the head reads the pre-norm state "
                                 "the draft feeds back, and vLLM's draft loop hands the proposer only the "
                                 "final-normed one; send it with stop_policy=FixedK, SVIP or OnlineAcceptance")
            logger.info("specdecpp.vllm: drafts stopped by %s %s", self.stop_policy.name, self.stop_policy.settings())
            self._runner = runner
            self._outcomes = Outcomes()
            self._load_aware_spec = read_load_aware(self.speculative_config.draft_model_config.model)
            self.load_aware: LoadAware | None = None

        def load_model(self, target_model) -> None:
            super().load_model(target_model)
            if self.stop_policy is None:
                return
            self._view = DraftView(self.model, self.speculative_config.draft_model_config.hf_config)
            spec = self._load_aware_spec
            if spec is not None:
                costs = spec["costs"] or self._measure_step_costs()
                self.load_aware = LoadAware(costs, self.stop_policy, self.num_speculative_tokens, spec["mode"])
                logger.info("specdecpp.vllm: load-aware lengths (%s draft passes) on step costs %s", spec["mode"],
                            costs.to_json())

        def _measure_step_costs(self):
            """The target's seconds over its token counts and one draft pass's over batch sizes, with
            vLLM's own dummy runs of the loaded models (``runner._dummy_run``, ``self.dummy_run``)."""
            runner = self._runner
            if runner is None or not hasattr(runner, "_dummy_run"):
                raise ValueError("load_aware=True measures the step costs with the model runner's dummy runs, "
                                 "which this proposer was built without: pass load_aware=StepCosts(...) or a JSON")
            if getattr(runner, "use_aux_hidden_state_outputs", False):
                # EAGLE-3: the runner sets the target's aux layers after the drafter's load_model, and its
                # dummy run unpacks (hidden, aux) from the target: set them now (the runner's call repeats it)
                runner._setup_eagle3_aux_hidden_state_outputs()
            max_reqs = runner.max_num_reqs
            k = self.num_speculative_tokens
            tokens = sorted({1, max_reqs, max_reqs * (k + 1) // 2, max_reqs * (k + 1)} & set(
                range(1, runner.max_num_tokens + 1)))
            batches = sorted({1, max(1, max_reqs // 2), max_reqs})
            with torch.inference_mode():
                costs = measure_step_costs(lambda n: runner._dummy_run(n, is_profile=True),
                                           lambda b: self.dummy_run(b), tokens, batches, repeats=3,
                                           meta={"how": "vLLM dummy runs at proposer start-up (no KV cache); "
                                                        "the draft's call of K passes divided by K", "K": k})
            return StepCosts(costs.target_tokens, costs.target_seconds, costs.draft_batch,
                             tuple(t / k for t in costs.draft_seconds), meta=costs.meta)

        def prepare_next_token_ids_cpu(self, sampled_token_ids, requests, gpu_input_batch, num_scheduled_tokens):
            out = super().prepare_next_token_ids_cpu(sampled_token_ids, requests, gpu_input_batch,
                                                     num_scheduled_tokens)
            if self.stop_policy is not None:
                self._outcomes.verified(gpu_input_batch.req_ids, [len(t) for t in sampled_token_ids])
            return out

        def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
            next_ids, valid = super().prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch,
                                                                    discard_request_mask)
            if self.stop_policy is not None and self._outcomes.pending:
                self._outcomes.verified(gpu_input_batch.req_ids, valid.tolist())
            return next_ids, valid

        def propose(self, num_speculative_tokens, *args, **kwargs):
            if self.stop_policy is None:
                return super().propose(num_speculative_tokens, *args, **kwargs)
            metadata = kwargs["common_attn_metadata"] if "common_attn_metadata" in kwargs else args[5]
            batch_size = metadata.batch_size()
            self._drafts = drafts = StoppedDrafts(self.stop_policy, num_speculative_tokens, self.load_aware)
            try:
                super().propose(num_speculative_tokens, *args, **kwargs)
            except AllStopped:
                pass
            finally:
                self._drafts = None
            self._last_draft_probs = drafts.stacked_probs()
            if self._runner is not None:
                self._outcomes.drafted(self._runner.input_batch.req_ids, drafts)
            return drafts.lists(batch_size)

        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            drafts = self._drafts
            if drafts is None:
                return super()._sample_draft_tokens(hidden_states, sampling_metadata)
            self._bind(sampling_metadata)
            drafts.temperature = self._bound_temperature
            logits = self.model.compute_logits(hidden_states)
            raw = logits if sampling_metadata.all_greedy else logits.clone()  # sampling divides in place
            tokens, probs = self._sample_from_logits(logits, sampling_metadata)
            if drafts.add(raw, hidden_states, tokens, probs):
                raise AllStopped
            return tokens, probs

        def _bind(self, sampling_metadata) -> None:
            temperature = temperature_of(sampling_metadata)
            if temperature != self._bound_temperature:
                self.stop_policy.bind(self._view, temperature)
                self._bound_temperature = temperature

    StopPolicyProposer.__name__ = StopPolicyProposer.__qualname__ = f"StopPolicy{name}"
    return StopPolicyProposer


def install_proposer() -> None:
    """The model runner builds a ``StopPolicyProposer`` where it would build ``DraftModelProposer``
    (method ``draft_model``) or ``EagleProposer`` (``eagle``, ``eagle3``)."""
    from vllm.v1.worker import gpu_model_runner

    gpu_model_runner.DraftModelProposer = proposer_class("draft_model")
    gpu_model_runner.EagleProposer = proposer_class("eagle3")


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """vLLM's ``expand_kernel`` (rejection_sampler.py) in torch: request i's value, with
    ``replace_from`` replaced by ``replace_to``, at its tokens ``cu[i-1]:cu[i]`` of ``output``."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = values.repeat_interleave(counts)
    output[: expanded.shape[0]].copy_(expanded.to(output.dtype))


def expand_bug_present(impl=None) -> bool:
    """Does the CPU stand-in of ``expand_kernel`` (``impl``; default: the installed one, vLLM's own
    if this process replaced it) leave a float output unwritten or wrong? False where vLLM has no
    such stand-in (e.g. on CUDA)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.utils import cpu_triton_utils

    current_platform.import_kernels()
    impl = impl or REPLACED.get("expand") or cpu_triton_utils._expand_kernel_impl
    values = torch.tensor([1.0, 0.5, 0.7])
    cu = torch.tensor([2, 4, 6], dtype=torch.int32)
    output = torch.full((6,), -7.0)
    impl(output, values, cu, 0, 1)
    return not torch.equal(output, values.repeat_interleave(2))


def install_expand_fix() -> bool:
    """Replace the CPU stand-in of ``expand_kernel`` where :func:`expand_bug_present`, unless
    ``SPECDECPP_VLLM_KEEP_CPU_EXPAND=1``; True if replaced."""
    if os.environ.get(KEEP_EXPAND_ENV) == "1" or "expand" in REPLACED or not expand_bug_present():
        return False
    from vllm.utils import cpu_triton_utils

    REPLACED["expand"] = cpu_triton_utils._expand_kernel_impl
    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    logger.warning("specdecpp.vllm: replaced vLLM's CPU expand_kernel (uninitialised per-token temperature in "
                   "sampled speculative decoding, docs/vllm.md); %s=1 keeps vLLM's", KEEP_EXPAND_ENV)
    return True


def top_k_bug_present(impl=None) -> bool:
    """Does the top-k-only path (``impl``; default: the installed one, vLLM's own if this process
    wrapped it) raise on an empty batch of logits?"""
    from vllm.v1.sample.ops import topk_topp_sampler

    impl = impl or REPLACED.get("top_k") or topk_topp_sampler.apply_top_k_only
    try:
        impl(torch.empty(0, 4), torch.empty(0, dtype=torch.int32))
    except RuntimeError:
        return True
    return False


def install_top_k_fix() -> bool:
    """Wrap ``apply_top_k_only`` to pass an empty batch through where :func:`top_k_bug_present`,
    unless ``SPECDECPP_VLLM_KEEP_CPU_TOP_K=1``; True if wrapped."""
    if os.environ.get(KEEP_TOP_K_ENV) == "1" or "top_k" in REPLACED or not top_k_bug_present():
        return False
    from vllm.v1.sample.ops import topk_topp_sampler

    original = REPLACED["top_k"] = topk_topp_sampler.apply_top_k_only

    @functools.wraps(original)
    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return logits if k.numel() == 0 else original(logits, k)

    topk_topp_sampler.apply_top_k_only = apply_top_k_only
    logger.warning("specdecpp.vllm: wrapped vLLM's apply_top_k_only (it raises on the empty batch a spec-decode step "
                   "with no draft tokens hands it, docs/vllm.md); %s=1 keeps vLLM's", KEEP_TOP_K_ENV)
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the proposer and the CPU fix (a vLLM
    outside the supported range is left alone, with a warning: the bundle's proposer refuses it)."""
    found = installed_version()
    if found is None or not SUPPORTED_MIN <= release(found[1]) < SUPPORTED_BELOW:
        logger.warning("specdecpp.vllm: vLLM %s is outside the supported range; its plugin does nothing", found)
        return
    install_proposer()
    install_expand_fix()
    install_top_k_fix()
