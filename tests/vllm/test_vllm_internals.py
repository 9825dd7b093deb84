"""The vLLM internals specdecpp/vllm/internals.py touches still have the shape it was written
against: a failure here names the internal that moved (read the module's docstring, then vLLM's
source of the new version, before widening specdecpp.vllm.version.SUPPORTED)."""

from __future__ import annotations

import inspect

from tests.helpers.vllm import require_vllm

require_vllm()

from specdecpp.vllm import internals  # noqa: E402
from tests.helpers.vllm import VLLM_WARNINGS  # noqa: E402

pytestmark = VLLM_WARNINGS


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_draft_model_proposer_and_its_draft_loop():
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    assert issubclass(DraftModelProposer, SpecDecodeBaseProposer)
    assert parameters(DraftModelProposer.__init__) == ["self", "vllm_config", "device", "runner"]
    assert parameters(DraftModelProposer._sample_draft_tokens) == ["self", "hidden_states", "sampling_metadata"]
    assert parameters(DraftModelProposer._sample_from_logits) == ["self", "logits", "sampling_metadata"]
    assert parameters(DraftModelProposer.load_model) == ["self", "target_model"]
    names = parameters(DraftModelProposer.propose)
    assert names[:2] == ["self", "num_speculative_tokens"] and names[7] == "common_attn_metadata", names
    loop = inspect.getsource(SpecDecodeBaseProposer.propose)
    # every pass samples through _sample_draft_tokens; the draft probabilities go out in _last_draft_probs
    assert loop.count("self._sample_draft_tokens(") == 3 and "self._last_draft_probs = " in loop
    assert "take_last_draft_probs" in dir(DraftModelProposer)


def test_the_runner_builds_its_proposer_from_a_module_name_and_takes_lists():
    from vllm.v1.worker import gpu_model_runner

    source = inspect.getsource(gpu_model_runner.GPUModelRunner)
    assert "self.drafter = DraftModelProposer(" in source
    assert "isinstance(self._draft_token_ids, list)" in source  # per-request lists are taken as they are
    assert "self._draft_probs[row_idx, :num_draft]" in source  # each request's own number of draft probs
    internals.install_proposer()
    assert gpu_model_runner.DraftModelProposer is internals.proposer_class()


def test_the_cpu_kernels_that_are_fixed():
    from vllm.platforms import cpu
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.ops import topk_topp_sampler

    original = internals.REPLACED.get("expand", cpu_triton_utils._expand_kernel_impl)
    assert parameters(original) == ["output", "input_val", "cu_num_tokens", "replace_from", "replace_to",
                                    "MAX_NUM_TOKENS"]
    assert parameters(internals.expand_kernel_impl) == parameters(original)
    # the platform reads the module attribute when it registers its kernels (after the plugins ran)
    assert "cpu_tl._expand_kernel_impl" in inspect.getsource(cpu.CpuPlatform.register_triton_kernel_overrides)
    assert parameters(internals.REPLACED.get("top_k", topk_topp_sampler.apply_top_k_only)) == ["logits", "k"]
    assert "apply_top_k_only(logits, k)" in inspect.getsource(topk_topp_sampler.apply_top_k_top_p_pytorch)


def test_async_scheduling_is_off_on_the_cpu():
    """The per-request lists need synchronous scheduling, which vLLM's CPU platform sets."""
    from vllm.platforms import cpu

    assert "scheduler_config.async_scheduling = False" in inspect.getsource(cpu)


def test_what_load_aware_lengths_and_the_online_estimator_touch():
    """The verdicts reach the proposer through prepare_next_token_ids_* (called before propose with the
    step's sampled tokens); start-up costs are measured with the runner's and the proposer's dummy runs."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.worker import gpu_model_runner

    assert parameters(DraftModelProposer.prepare_next_token_ids_cpu) == [
        "self", "sampled_token_ids", "requests", "gpu_input_batch", "num_scheduled_tokens"]
    assert parameters(DraftModelProposer.prepare_next_token_ids_padded) == [
        "self", "sampled_token_ids", "requests", "gpu_input_batch", "discard_request_mask"]
    assert parameters(DraftModelProposer.dummy_run)[:2] == ["self", "num_tokens"]
    source = inspect.getsource(gpu_model_runner.GPUModelRunner)
    # the runner prepares the next token ids (the verdicts) before it calls propose, in the same step
    assert source.index("self.drafter.prepare_next_token_ids_padded(") < source.rindex("self.drafter.propose(")
    runner_run = parameters(gpu_model_runner.GPUModelRunner._dummy_run)
    assert runner_run[:2] == ["self", "num_tokens"] and "is_profile" in runner_run
    assert "self.max_num_reqs" in source and "self.max_num_tokens" in source
    from vllm.v1.worker.gpu_input_batch import InputBatch

    assert "req_ids" in dir(InputBatch)
