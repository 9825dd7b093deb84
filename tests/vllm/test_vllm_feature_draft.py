"""A FeatureDraft (EAGLE-3, speculators format) loads and decodes in vLLM: vLLM's own ``eagle3``
method gives target-only's greedy tokens with drafts accepted, its draft model's logits equal
``FeatureDraft.forward``'s on the same inputs, and ``specdecpp.vllm.speculative_config`` sends a
feature draft with FixedK, SVIP (each request's own length), OnlineAcceptance and load-aware lengths
to vLLM's EAGLE proposer: greedy output is target-only's, and sampled output (T=1, top-k 50) follows
the target's distribution. A lag-free head trained on the feature draft is sent too: greedy output is
target-only's, each request stops at its own length, and the features it scores vLLM's candidates from
equal those the library's SpeculativeDecoder hands it for the same prefix and depth; the paper's head of
the feature draft gives target-only's tokens at per-request lengths; heads for another draft and a
norm_output=false draft are refused before vLLM starts.

The pair is built so that the draft tracks the target (module ``tracking_pair``): a random tiny
Llama target whose next token depends mostly on its last token (its layers scaled down, its
embedding in 64 of 128 dimensions plus a constant one), and a ``FeatureDraft.init_from`` it, over
every other id (the d2t mapping is exercised), whose attention is rebuilt to read the current
token's embedding (queries and keys from the constant dimension peak at distance 0 under RoPE) and
whose other weights are perturbed. Acceptance is then high but below 1, and a wrong id mapping or
wrong inputs in vLLM would bring it to about 0.

One engine at a time (vLLM starts in ~10-20 s here); each is closed before the next starts."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.helpers.vllm import require_vllm

require_vllm()

import torch  # noqa: E402

from specdecpp import (  # noqa: E402
    SVIP,
    AcceptanceHead,
    FixedK,
    NextTokenHead,
    SamplingConfig,
    SpecDecPP,
    SpeculativeDecoder,
)
from specdecpp.core.sampling import entropy  # noqa: E402
from specdecpp.models.feature_draft import FeatureDraft  # noqa: E402
from specdecpp.models.identity import portable_name  # noqa: E402
from specdecpp.vllm import internals, speculative_config  # noqa: E402
from specdecpp.vllm.acceptance import OnlineAcceptance, OnlineAcceptanceEstimator  # noqa: E402
from tests.helpers.tiny import build_tokenizer, tiny_lm  # noqa: E402
from tests.helpers.vllm import VLLM_WARNINGS, close, recorded_lengths, spec_metrics, start  # noqa: E402

pytestmark = VLLM_WARNINGS

PROMPTS = ["Write a short poem about the sea.", "Explain how a binary search works.", "def add(a, b):",
           "The quick brown fox", "What is 12 times 7?", "Give three tips for staying healthy."]
MAX_TOKENS = 24
HIDDEN, HALF, HEAD_DIM = 128, 64, 32  # the target's width, the embedding's used dimensions, vLLM's CPU head size
CONST = 3.0  # the embedding's constant dimension (index HALF)
K = 3  # vLLM's num_speculative_tokens for its own eagle3 method


def perturb(module: torch.nn.Module, scale: float, generator: torch.Generator) -> None:
    """Add noise of ``scale`` times each weight's std (at least 1e-3) to the weights of ``module`` but its
    embedding (a draft's frozen copy of the target's: vLLM then shares the target's)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.is_floating_point() and p.numel() > 1 and not name.startswith("embed_tokens"):
                p.add_(torch.randn(p.shape, generator=generator) * scale * p.std().clamp_min(1e-3))


def tracking_pair(root, vocab: int | None = None):
    """The target (with the tests' tokenizer, or over ``vocab`` ids without one) and a FeatureDraft of
    it that tracks it, saved under ``root``; returns (target_dir, draft_dir, target, draft)."""
    tok = build_tokenizer() if vocab is None else None
    vocab = len(tok) if tok is not None else vocab
    target = tiny_lm(vocab, HIDDEN, 4, seed=12, scale=0.15, heads=4)  # head_dim 32, 2 KV heads
    with torch.no_grad():
        embed = target.model.embed_tokens.weight
        embed[:, HALF:] = 0.0
        embed[:, HALF] = CONST
        for layer in target.model.layers:  # a little context on top of the last token's bigram
            layer.self_attn.o_proj.weight.mul_(0.003)
            layer.mlp.down_proj.weight.mul_(0.003)
        head = target.lm_head.weight
        head[:, HALF:] = 0.0
        head[1::2] *= 0.5  # the draft keeps the even ids: the target prefers them
        if tok is None:
            head *= 6.0  # for sampling: peakier target distributions (at T=1 the tokenizer pair's are near uniform)
    if tok is not None:
        target.config.update({"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
                              "pad_token_id": tok.pad_token_id})
    target.save_pretrained(root / "target")
    if tok is not None:
        tok.save_pretrained(root / "target")

    generator = torch.Generator().manual_seed(3)
    draft = FeatureDraft.init_from(target, draft_vocab=torch.arange(0, vocab, 2), generator=generator)
    layer, attn = draft.layers[0], draft.layers[0].self_attn
    heads, kv_heads = attn.heads, attn.kv_heads
    perturb(draft, 0.05, generator)
    with torch.no_grad():
        # queries and keys: one constant direction (from the embedding's constant dimension), so the
        # scores peak at distance 0 under RoPE and each position reads its own token
        c = torch.full((HEAD_DIM,), 1.5) + 0.05 * torch.randn(HEAD_DIM, generator=generator)
        attn.q_proj.weight.mul_(0.01)[:, HALF] = c.repeat(heads)
        attn.k_proj.weight.mul_(0.01)[:, HALF] = c.repeat(kv_heads)
        # values: the embedding's used dimensions; out: KV head g to dimensions g*32.. (one query head of each)
        attn.v_proj.weight.mul_(0.01)[:, :HALF] += torch.eye(HALF)
        attn.o_proj.weight.mul_(0.01)
        for g in range(kv_heads):
            q_head = g * (heads // kv_heads)
            attn.o_proj.weight[g * HEAD_DIM:(g + 1) * HEAD_DIM, q_head * HEAD_DIM:(q_head + 1) * HEAD_DIM] += torch.eye(
                HEAD_DIM)
        layer.mlp.down_proj.weight.mul_(0.01)
        layer.hidden_norm.weight.fill_(0.05)  # the target's features: a small part of the residual
        draft.norm.weight.mul_(8.0)  # peakier draft distributions (SVIP's entropies spread)
    draft.save_pretrained(root / "draft")
    return root / "target", root / "draft", target, draft.eval()


def greedy_tokens(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)  # the pair's outputs hit EOS soon
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tracking_pair(tmp_path_factory.mktemp("vllm_feature_pair"))


@pytest.fixture(scope="module")
def reference(pair):
    """vLLM target-only's greedy tokens."""
    llm = start(pair[0])
    try:
        return greedy_tokens(llm)
    finally:
        close(llm)


def test_the_eagle_proposer_internals():
    """What the EAGLE subclass relies on (specdecpp/vllm/internals.py): EagleProposer runs the base
    class's draft loop unchanged, the runner builds it by the name rebound, vLLM's other subclass of
    it still passes the runner's isinstance checks, and the EAGLE-3 model scatters its logits."""
    import inspect

    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.spec_decode.step3p5 import Step3p5MTPProposer
    from vllm.v1.worker import gpu_model_runner

    from specdecpp.vllm import internals

    assert EagleProposer.__bases__ == (SpecDecodeBaseProposer,)
    assert list(inspect.signature(EagleProposer.__init__).parameters) == ["self", "vllm_config", "device", "runner"]
    for name in ("propose", "_sample_draft_tokens", "_sample_from_logits", "load_model", "prepare_next_token_ids_cpu",
                 "prepare_next_token_ids_padded"):
        assert name not in vars(EagleProposer), name  # the loop and the hooks the subclass overrides are the base's
    source = inspect.getsource(gpu_model_runner.GPUModelRunner)
    assert "self.drafter = EagleProposer(self.vllm_config, self.device, self)" in source
    assert re.search(r"isinstance\(\s*self\.drafter,\s*EagleProposer", source)
    internals.install_proposer()
    eagle = internals.proposer_class("eagle3")
    assert gpu_model_runner.EagleProposer is eagle and issubclass(eagle, EagleProposer)
    assert gpu_model_runner.DraftModelProposer is internals.proposer_class("draft_model")
    assert issubclass(Step3p5MTPProposer, EagleProposer)
    assert isinstance(object.__new__(Step3p5MTPProposer), eagle)  # built by its own name, checked by the rebound one
    assert not isinstance(object.__new__(DraftModelProposer), eagle)
    assert list(inspect.signature(Eagle3LlamaForCausalLM.compute_logits).parameters) == ["self", "hidden_states"]
    # measuring step costs at the drafter's load_model: the aux layers are set after it, by a method it can call
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    load = inspect.getsource(CPUModelRunner.load_model)
    assert load.index("self.drafter.load_model(") < load.index("self._setup_eagle3_aux_hidden_state_outputs()")
    assert list(inspect.signature(gpu_model_runner.GPUModelRunner._setup_eagle3_aux_hidden_state_outputs).parameters) \
        == ["self"]
    assert "self.use_aux_hidden_state_outputs = (" in source
    assert 'float("-inf")' in inspect.getsource(Eagle3LlamaForCausalLM.compute_logits)


def test_speculative_config_sends_a_feature_draft_as_eagle3(pair, tmp_path):
    from specdecpp.vllm.config import POLICY_FILE, read_policy
    from tests.vllm.test_vllm_greedy import varied_head

    draft_dir = pair[1]
    spec = speculative_config(draft_dir, stop_policy=SVIP(0.5, max_candidates=4), cache_dir=tmp_path)
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 4
    bundle = tmp_path / spec["model"].rsplit("/", 1)[-1]
    assert (bundle / POLICY_FILE).is_file() and (bundle / "config.json").resolve() == (draft_dir / "config.json")
    assert json.loads((bundle / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert read_policy(bundle).settings() == SVIP(0.5, max_candidates=4).settings()
    assert speculative_config(draft_dir, stop_policy=FixedK(2), cache_dir=tmp_path)["method"] == "eagle3"
    with pytest.raises(ValueError, match="its draft had hidden_size 64 .* has hidden_size 128"):  # a plain draft's
        speculative_config(draft_dir, head=varied_head("next", 2), threshold=0.5, cache_dir=tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((draft_dir / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "speculators_model_type": "eagle"}))
    with pytest.raises(ValueError, match="only 'eagle3'"):
        speculative_config(broken, stop_policy=FixedK(2), cache_dir=tmp_path)


class DraftCalls:
    """What vLLM's EAGLE-3 draft model is handed and returns, recorded call by call: the fused target
    states its fc reads (``combine_hidden_states``' input) and the logits of every drafting pass."""

    def __init__(self, monkeypatch) -> None:
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

        self.features: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        combine, logits = Eagle3LlamaForCausalLM.combine_hidden_states, Eagle3LlamaForCausalLM.compute_logits

        def combine_hidden_states(model, hidden_states):
            self.features.append(hidden_states.detach().clone())
            return combine(model, hidden_states)

        def compute_logits(model, hidden_states):
            out = logits(model, hidden_states)
            self.logits.append(out.detach().clone())
            return out

        monkeypatch.setattr(Eagle3LlamaForCausalLM, "combine_hidden_states", combine_hidden_states)
        monkeypatch.setattr(Eagle3LlamaForCausalLM, "compute_logits", compute_logits)


def replay(draft: FeatureDraft, prompt: list[int], first: int, features: torch.Tensor, proposed: list[int]):
    """FeatureDraft.forward's logits [K, V] for vLLM's first propose call after the prefill of ``prompt``
    (the target's token ``first``): the prompt shifted by one with ``features`` [n, F*H], then one
    step per proposed token, fed its own hidden output (the module docstring's shift convention)."""
    cache = draft.new_cache()
    with torch.no_grad():
        out = draft(torch.tensor([prompt[1:] + [first]]), features=features[None], cache=cache, n_logits=1)
        logits = [out.logits[0, -1]]
        for token in proposed:
            out = draft(torch.tensor([[token]]), hidden=out.hidden[:, -1:], cache=cache)
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


@pytest.fixture(scope="module")
def vllm_eagle3(pair):
    """vLLM's own eagle3 method with our checkpoint (no bundle: vLLM's proposer as it is): the greedy
    tokens and spec-decode counters on PROMPTS, then one prompt's first propose call recorded."""
    from vllm import SamplingParams

    llm = start(pair[0], {"method": "eagle3", "model": str(pair[1]), "num_speculative_tokens": K})
    try:
        tokens = greedy_tokens(llm)
        metrics = spec_metrics(llm)
        with pytest.MonkeyPatch.context() as monkeypatch:
            calls = DraftCalls(monkeypatch)
            out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)[0]
    finally:
        close(llm)
    return {"tokens": tokens, "metrics": metrics, "calls": calls, "prompt": list(out.prompt_token_ids),
            "first": out.outputs[0].token_ids[0]}


def test_vllm_eagle3_decodes_our_checkpoint_losslessly(pair, reference, vllm_eagle3):
    """vLLM's own eagle3 method with our checkpoint: target-only's tokens, drafts accepted, and its
    draft's features and logits equal ours (FeatureDraft.forward on the same inputs)."""
    _, _, target, draft = pair
    metrics = vllm_eagle3["metrics"]
    assert vllm_eagle3["tokens"] == reference
    accepted, drafted = metrics["num_accepted_tokens"], metrics["num_draft_tokens"]
    print(f"eagle3 acceptance {accepted}/{drafted}, per position {metrics['num_accepted_tokens_per_pos']}")
    # the pair tracks: a wrong id mapping, aux layer or shift in vLLM would bring this to about 0
    assert drafted > 0 and 0.3 < accepted / drafted < 1.0, metrics


def test_vllm_eagle3_draft_logits_equal_feature_draft_forward(pair, vllm_eagle3):
    """The first propose call after a prefill: vLLM's fused target states equal ``draft.fuse`` of
    transformers' hidden states, and its K passes' logits equal FeatureDraft.forward's on those
    features and vLLM's own draft tokens."""
    _, _, target, draft = pair
    calls, prompt, first = vllm_eagle3["calls"], vllm_eagle3["prompt"], vllm_eagle3["first"]
    k = K
    features, logits = calls.features[0], torch.cat(calls.logits[:k])
    assert features.shape == (len(prompt), len(draft.aux_layers) * HIDDEN) and logits.shape == (k, draft.vocab_size)
    with torch.no_grad():
        expected = draft.fuse(target(torch.tensor([prompt]), output_hidden_states=True).hidden_states)[0]
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=1e-4)  # vLLM's aux layers are our ids
    proposed = logits.argmax(-1).tolist()  # vLLM's greedy drafts
    assert all(t % 2 == 0 for t in proposed)  # through d2t: the draft's ids are the even target ids
    ours = replay(draft, prompt, first, features, proposed[:-1])
    assert torch.equal(torch.isfinite(ours), torch.isfinite(logits))  # -inf off the draft vocabulary, both
    kept = torch.isfinite(logits)
    assert int(kept[0].sum()) == draft.draft_vocab_size
    print(f"max |ours - vLLM's| over the draft vocabulary: {(ours[kept] - logits[kept]).abs().max():.2e}")
    torch.testing.assert_close(ours[kept], logits[kept], atol=2e-4, rtol=1e-4)
    # the check can fail: the features of other layers move the logits far beyond its tolerance
    shifted = draft.fuse(target(torch.tensor([prompt]), output_hidden_states=True).hidden_states[1:])[0]
    wrong = replay(draft, prompt, first, shifted, proposed[:-1])
    print(f"with the features of the layers above: {(wrong[kept] - logits[kept]).abs().max():.2e}")
    assert (wrong[kept] - logits[kept]).abs().max() > 50 * 2e-4


# SVIP's threshold: the median of c*H over the draft's logits on the reference (set in the test)
POLICIES = {"fixed_k": lambda threshold: FixedK(K), "svip": lambda threshold: SVIP(threshold, max_candidates=4)}


def svip_median_threshold(pair, reference, c: float = 0.15) -> float:
    """sqrt(c * median H) of the draft's entropies along the reference outputs (teacher-forced with
    the target's features), so that SVIP stops about half of the rows at each pass."""
    target_dir, _, target, draft = pair
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    values = []
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, reference, strict=True):
            ids = tok(prompt)["input_ids"] + out
            features = draft.fuse(target(torch.tensor([ids]), output_hidden_states=True).hidden_states)
            logits = draft(torch.tensor([ids[1:]]), features=features[:, :-1]).logits[0]
            values.append(entropy(logits))
    return math.sqrt(c * float(torch.cat(values).median()))


@pytest.mark.parametrize("name", list(POLICIES))
def test_speculative_config_with_a_feature_draft_gives_target_only_tokens(pair, reference, vllm_eagle3, tmp_path,
                                                                          name):
    policy = POLICIES[name](svip_median_threshold(pair, reference) if name == "svip" else None)
    spec = speculative_config(pair[1], stop_policy=policy, cache_dir=tmp_path)
    assert spec["method"] == "eagle3"
    llm = start(pair[0], spec)
    try:
        with recorded_lengths() as lengths:
            tokens = greedy_tokens(llm)
        metrics = spec_metrics(llm)
    finally:
        close(llm)
    assert tokens == reference
    assert lengths, "specdecpp.vllm's EAGLE proposer did not run (is the vllm.general_plugins entry point installed?)"
    print(f"{name}: acceptance {metrics['num_accepted_tokens']}/{metrics['num_draft_tokens']}, lengths {lengths[:4]}")
    assert all(0 < n <= spec["num_speculative_tokens"] for step in lengths for n in step)
    assert metrics["num_accepted_tokens"] > 0
    assert metrics["num_draft_tokens"] <= sum(map(sum, lengths))
    if name == "fixed_k":  # FixedK(K) is vLLM's own eagle3 method, draft for draft
        assert all(n == K for step in lengths for n in step)
        assert metrics == vllm_eagle3["metrics"]
    else:  # per-request lengths reach vLLM's scheduler: they differ within one step
        assert any(len(set(step)) > 1 for step in lengths), lengths


def test_load_aware_lengths_and_the_online_estimator_with_a_feature_draft(pair, reference, tmp_path, monkeypatch):
    """As tests/vllm/test_vllm_load_aware.py does for a plain draft: a flat step-cost curve keeps
    FixedK's lengths, a steep one cuts them (some to 0), and with OnlineAcceptance and costs measured
    at start-up (vLLM's dummy runs of the target and the EAGLE draft) the estimator is fed the target's
    verdicts; greedy output is target-only's throughout."""
    from tests.vllm.test_vllm_load_aware import FLAT, STEEP

    measured, fed = [], []
    original_measure, original_observe = internals.measure_step_costs, OnlineAcceptanceEstimator.observe

    def measure(*args, **kwargs):
        measured.append(original_measure(*args, **kwargs))
        return measured[-1]

    def observe(self, features, num_drafted, num_accepted, predictions=None):
        fed.append((list(num_drafted), list(num_accepted)))
        return original_observe(self, features, num_drafted, num_accepted, predictions)

    monkeypatch.setattr(internals, "measure_step_costs", measure)
    monkeypatch.setattr(OnlineAcceptanceEstimator, "observe", observe)
    runs = {}
    for name, spec in (("flat", {"stop_policy": FixedK(3), "load_aware": FLAT}),
                       ("steep", {"stop_policy": FixedK(3), "load_aware": STEEP}),
                       ("online", {"stop_policy": OnlineAcceptance(0.7, max_candidates=3, refit_interval=5),
                                   "load_aware": True})):
        fed.clear()
        llm = start(pair[0], speculative_config(pair[1], cache_dir=tmp_path, **spec))
        try:
            with recorded_lengths() as lengths:
                tokens = greedy_tokens(llm)
            metrics = spec_metrics(llm)
        finally:
            close(llm)
        assert tokens == reference, name
        assert lengths, name
        runs[name] = (lengths, metrics, list(fed))
    assert all(n == 3 for step in runs["flat"][0] for n in step)
    steep = [n for step in runs["steep"][0] for n in step]
    assert all(0 <= n <= 3 for n in steep) and 0 in steep and sum(steep) / len(steep) < 2.0, runs["steep"][0]
    assert len(measured) == 1 and measured[0].target_seconds[-1] > 0 and measured[0].draft_seconds[-1] > 0
    _, online_metrics, fed = runs["online"]
    assert len(fed) >= 5, fed
    drafted = [d for step, _ in fed for d in step]
    accepted = [a for _, step in fed for a in step]
    print(f"online: fed {sum(accepted)}/{sum(drafted)}, vLLM counted {online_metrics['num_accepted_tokens']}/"
          f"{online_metrics['num_draft_tokens']}")
    # the verdicts fed are vLLM's (less those of the last step, never verified before the end)
    assert all(0 < d <= 3 for d in drafted) and 0 < sum(accepted) <= online_metrics["num_accepted_tokens"]
    assert sum(drafted) <= online_metrics["num_draft_tokens"] + len(PROMPTS) * 3


def test_sampled_decoding_with_a_feature_draft_follows_the_target(tmp_path):
    """T=1, top-k 50 (the paper's setting) with SVIP stopping a feature draft's requests: the first two
    tokens follow the target's distribution (chi-square against exact enumeration, as
    tests/vllm/test_vllm_sampling.py does for a plain draft). The draft scores only the even ids
    (q = 0 elsewhere), so the target's odd tokens come only from the rejection sampler's residual."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.helpers.stats import chi_square_pvalue
    from tests.vllm.test_vllm_sampling import PROMPT, SAMPLES, exact_pairs

    target_dir, draft_dir, target, draft = tracking_pair(tmp_path, vocab=64)
    ids = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = draft.fuse(target(ids, output_hidden_states=True).hidden_states)
        h = entropy(draft(ids[:, 1:], features=features[:, :-1]).logits[0])
    spec = speculative_config(draft_dir, stop_policy=SVIP(math.sqrt(0.15 * float(h.median())), max_candidates=3),
                              cache_dir=tmp_path / "bundles")
    llm = start(target_dir, spec, skip_tokenizer_init=True, max_model_len=64, max_num_seqs=64)
    try:
        with recorded_lengths() as lengths:
            outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * SAMPLES,
                                SamplingParams(temperature=1.0, top_k=50, max_tokens=3, detokenize=False,
                                               ignore_eos=True), use_tqdm=False)
        metrics = spec_metrics(llm)
    finally:
        close(llm)
    samples = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    print(f"sampled: acceptance {metrics['num_accepted_tokens']}/{metrics['num_draft_tokens']}, "
          f"odd first tokens {sum(s[0] % 2 for s in samples)}/{len(samples)}")
    assert chi_square_pvalue(samples, exact_pairs(target_dir)) > 1e-3
    assert any(len(set(step)) > 1 for step in lengths)  # rows stopped at their own lengths
    assert metrics["num_accepted_tokens"] > 0.1 * metrics["num_drafts"]
    assert any(s[0] % 2 for s in samples)  # tokens off the draft's vocabulary, from the residual


# -- a lag-free head with the feature draft -------------------------------------------------------------------
HEAD_THRESHOLD, HEAD_K = 0.5, 4


def feature_head(recorded, seed: int = 5) -> NextTokenHead:
    """A lag-free head of the pair's width recorded as trained on draft ``recorded`` (what train records:
    ``portable_name`` of pair.draft), its output scaled so its predictions vary from candidate to
    candidate and requests stop at different lengths (a random head's logits are small)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = NextTokenHead(HIDDEN, depth=1, draft=None if recorded is None else portable_name(recorded))
    with torch.no_grad():
        head.out.weight.mul_(20.0)
        head.out.bias.fill_(1.5)
    return head.eval()


def feature_paper_head(recorded, seed: int = 6) -> AcceptanceHead:
    """The paper's head (kind ``resnet``, one candidate of lag) of the pair's width, recorded as trained on
    draft ``recorded``, its output scaled so that requests stop at different lengths."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = AcceptanceHead(HIDDEN, depth=1, draft=portable_name(recorded))
    with torch.no_grad():
        head.out.weight.mul_(20.0)
        head.out.bias.fill_(1.5)
    return head.eval()


def test_the_papers_head_with_a_feature_draft_gives_target_only_tokens_at_per_request_lengths(pair, reference,
                                                                                              tmp_path):
    """The paper's head on a feature draft in vLLM: it scores candidate k from the state vLLM's EAGLE loop hands
    the proposer at pass k+1 (the draft's state after feeding it, which is what the library hands it and what
    train computes: tests/training/test_engine_features.py); greedy output equals target-only's and requests
    stop at their own lengths."""
    spec = speculative_config(pair[1], head=feature_paper_head(pair[1]), threshold=HEAD_THRESHOLD,
                              max_candidates=HEAD_K, cache_dir=tmp_path)
    llm = start(pair[0], spec)
    try:
        with recorded_lengths() as lengths:
            tokens = greedy_tokens(llm)
    finally:
        close(llm)
    assert tokens == reference
    assert lengths and all(0 < n <= HEAD_K for step in lengths for n in step)
    assert len({n for step in lengths for n in step}) >= 2, lengths  # the head, not K, stops them


def test_a_head_is_checked_against_the_feature_draft_before_vllm_starts(pair, tmp_path):
    """A lag-free head trained on this feature draft (recorded by path or, with draft_name, by another
    name) is sent as eagle3 with its head in the bundle; one trained on another feature draft of the same
    target (the same hidden size: only the name tells them apart), on a plain draft of another size, the
    and a norm_output=false draft are refused with the reason; the paper's head of this draft is sent. No engine is
    started."""
    from specdecpp.vllm.config import HEAD_DIR, read_policy
    from tests.vllm.test_vllm_greedy import varied_head

    target, draft_dir = pair[2], pair[1]
    spec = speculative_config(draft_dir, head=feature_head(draft_dir), threshold=0.5, max_candidates=HEAD_K,
                              cache_dir=tmp_path)
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == HEAD_K
    policy = read_policy(spec["model"])
    assert isinstance(policy, SpecDecPP) and policy.head.kind == "next" and policy.threshold == 0.5
    assert (tmp_path / spec["model"].rsplit("/", 1)[-1] / HEAD_DIR / "config.json").is_file()
    link = tmp_path / "link"
    link.symlink_to(draft_dir)  # the same directory under another path
    assert speculative_config(link, head=feature_head(draft_dir), threshold=0.5, cache_dir=tmp_path)["method"] == \
        "eagle3"
    assert speculative_config(draft_dir, head=feature_head(None), threshold=0.5, cache_dir=tmp_path)  # unrecorded

    other = FeatureDraft.init_from(target, generator=torch.Generator().manual_seed(9))
    other.save_pretrained(tmp_path / "other_draft")
    assert other.hidden_size == HIDDEN
    with pytest.raises(ValueError, match=r"does not match the configured draft: it was trained on draft '.*other_dr"):
        speculative_config(draft_dir, head=feature_head(tmp_path / "other_draft"), threshold=0.5, cache_dir=tmp_path)
    assert speculative_config(tmp_path / "other_draft", head=feature_head(tmp_path / "other_draft"), threshold=0.5,
                              cache_dir=tmp_path)["method"] == "eagle3"  # with its own draft it fits
    with pytest.raises(ValueError, match="pass draft_name=<that name>"):
        speculative_config(draft_dir, head=feature_head("org/feature-draft"), threshold=0.5, cache_dir=tmp_path)
    assert speculative_config(draft_dir, head=feature_head("org/feature-draft"), threshold=0.5, cache_dir=tmp_path,
                              draft_name="org/feature-draft")["method"] == "eagle3"
    with pytest.raises(ValueError, match="its draft had hidden_size 64"):
        speculative_config(draft_dir, head=varied_head("next", 2), threshold=0.5, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="its draft had hidden_size 64"):  # the paper's head of a plain draft
        speculative_config(draft_dir, head=varied_head("resnet", 1), threshold=0.5, cache_dir=tmp_path)
    paper = speculative_config(draft_dir, head=feature_paper_head(draft_dir), threshold=0.5, cache_dir=tmp_path)
    assert paper["method"] == "eagle3" and read_policy(paper["model"]).head.kind == "resnet"
    unnormed = tmp_path / "unnormed"
    unnormed.mkdir()
    config = json.loads((draft_dir / "config.json").read_text())
    (unnormed / "config.json").write_text(json.dumps({**config, "norm_output": False}))
    (unnormed / "model.safetensors").symlink_to(draft_dir / "model.safetensors")
    with pytest.raises(ValueError, match="norm_output=false"):
        speculative_config(unnormed, head=feature_head(unnormed), threshold=0.5, cache_dir=tmp_path)
    assert speculative_config(unnormed, stop_policy=SVIP(0.5), cache_dir=tmp_path)["method"] == "eagle3"


class HeadCalls:
    """Every lag-free head's scoring in this process (vLLM's engine runs in it, and so does the library's
    decoder), by round (``SpecDecPP.begin_round``: a vLLM propose call, a library round): per scored pass,
    the candidates [B] and the features [B, F] the head scored them from."""

    def __init__(self, monkeypatch) -> None:
        self.rounds: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        score, begin = NextTokenHead.score, SpecDecPP.begin_round

        def spy_score(head, hidden, logits, token, positions=None):
            feats = head.features_of(hidden, logits, token, positions=positions)
            self.rounds[-1].append((token.detach().cpu().reshape(-1).clone(),
                                    feats.detach().cpu().reshape(token.numel(), -1).clone()))
            return score(head, hidden, logits, token, positions)

        def spy_begin(policy, generated=None):
            self.rounds.append([])
            return begin(policy, generated)

        monkeypatch.setattr(NextTokenHead, "score", spy_score)
        monkeypatch.setattr(SpecDecPP, "begin_round", spy_begin)


@pytest.fixture(scope="module")
def vllm_head(pair, tmp_path_factory):
    """vLLM with the feature draft and a lag-free head: greedy tokens and draft lengths on PROMPTS, then
    two prompts alone (one request per propose call) with the head's scoring and the draft lists recorded."""
    from vllm import SamplingParams

    from specdecpp.vllm import drafts

    spec = speculative_config(pair[1], head=feature_head(pair[1]), threshold=HEAD_THRESHOLD, max_candidates=HEAD_K,
                              cache_dir=tmp_path_factory.mktemp("head_bundles"))
    llm = start(pair[0], spec)
    try:
        with recorded_lengths() as lengths:
            tokens = greedy_tokens(llm)
        metrics = spec_metrics(llm)
        alone = []
        with pytest.MonkeyPatch.context() as monkeypatch:
            calls, lists, original = HeadCalls(monkeypatch), [], drafts.StoppedDrafts.lists

            def record_lists(self, batch_size):
                lists.append(original(self, batch_size))
                return lists[-1]

            monkeypatch.setattr(drafts.StoppedDrafts, "lists", record_lists)
            for prompt in (PROMPTS[0], PROMPTS[2]):  # other last tokens: other outputs
                calls.rounds.clear()
                lists.clear()
                out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                   use_tqdm=False)[0]
                alone.append({"prompt": list(out.prompt_token_ids), "out": list(out.outputs[0].token_ids),
                              "rounds": list(calls.rounds), "lists": [row for step in lists for row in step]})
    finally:
        close(llm)
    return {"spec": spec, "tokens": tokens, "lengths": lengths, "metrics": metrics, "alone": alone}


def test_a_head_with_a_feature_draft_gives_target_only_tokens_at_per_request_lengths(reference, vllm_head):
    tokens, lengths, metrics = vllm_head["tokens"], vllm_head["lengths"], vllm_head["metrics"]
    assert tokens == reference
    assert lengths, "specdecpp.vllm's EAGLE proposer did not run (is the vllm.general_plugins entry point installed?)"
    print(f"head: acceptance {metrics['num_accepted_tokens']}/{metrics['num_draft_tokens']}, lengths {lengths[:6]}")
    assert all(0 < n <= HEAD_K for step in lengths for n in step)
    assert metrics["num_accepted_tokens"] > 0 and metrics["num_draft_tokens"] <= sum(map(sum, lengths))
    assert any(len(set(step)) > 1 for step in lengths), lengths  # per-request lengths within one step
    assert len({n for step in lengths for n in step}) >= 3, lengths  # the head, not K, stops them


def library_round(decoder, calls: HeadCalls, prefix: list[int]) -> list[tuple[int, torch.Tensor]]:
    """The library's round after ``prefix`` (the target's greedy tokens after its prompt part): (candidate,
    the features the head scored it from) by depth. A feature draft drafts nothing in a decoder's first
    round (the target's prefill makes the features it reads), so the decoder is given ``prefix[:-1]``: its
    first round commits the target's ``prefix[-1]``, its second drafts after ``prefix``, as vLLM's propose
    call after the step that committed ``prefix[-1]`` does."""
    calls.rounds.clear()
    out = decoder.generate(torch.tensor([prefix[:-1]]), max_new_tokens=HEAD_K + 2)
    assert out.tokens[0, len(prefix) - 1] == prefix[-1] and calls.rounds[0] == []
    return [(int(t), f[0]) for t, f in calls.rounds[1]]


def test_the_head_scores_vllms_candidates_from_the_features_the_library_hands_it(pair, vllm_head, monkeypatch):
    """For every propose call of one request alone, the head's features for each candidate vLLM drafted
    equal those the library's SpeculativeDecoder (greedy, the same head and threshold) computes for the same
    prefix at the same depth (about 4e-5 apart in float32); checked on committed candidates at depths 1 and
    >= 2 (and on the rejected ones: both draft the same candidates, and the head stops both at the same one).
    The check can fail: the library on a draft feeding back its pre-norm state (norm_output=false, the
    state vLLM does not hand the proposer) gives other features."""
    import copy

    _, _, target, draft = pair
    head = feature_head(pair[1])
    head.attach(draft)
    calls = HeadCalls(monkeypatch)
    decoder = SpeculativeDecoder(draft, target, SpecDecPP(head, HEAD_THRESHOLD, max_candidates=HEAD_K),
                                 SamplingConfig(temperature=0))
    checked, worst = {"committed k=1": 0, "committed k>=2": 0, "other": 0}, 0.0
    first_prefix, stops_agree, eos = None, 0, target.config.eos_token_id
    for run in vllm_head["alone"]:
        prompt, out = run["prompt"], run["out"]
        assert len(run["rounds"]) == len(run["lists"])  # one round per propose call of the one request
        g = 1  # output tokens committed before the propose call (the prefill's first)
        for scored, drafted in zip(run["rounds"], run["lists"], strict=True):
            if g >= len(out):
                break
            assert [int(t) for t, _ in scored] == drafted[: len(scored)]  # the head scored vLLM's candidates
            accepted = 0
            while accepted < len(drafted) and g + accepted < len(out) and drafted[accepted] == out[g + accepted]:
                accepted += 1
            prefix = prompt + out[:g]
            first_prefix = first_prefix or prefix
            ours = library_round(decoder, calls, prefix)
            # the head stops both at the same candidate (the library's round also ends at an EOS candidate)
            assert len(ours) == len(drafted) or (len(ours) < len(drafted) and ours[-1][0] == eos), (prefix, drafted)
            stops_agree += 1
            for k, ((token, feats), (lib_token, lib_feats)) in enumerate(zip(scored, ours, strict=False), start=1):
                assert lib_token == int(token), (prefix, k)  # both draft greedily from the same state
                torch.testing.assert_close(feats[0], lib_feats, atol=2e-4, rtol=1e-4)
                worst = max(worst, float((feats[0] - lib_feats).abs().max()))
                checked["other" if k > accepted else "committed k=1" if k == 1 else "committed k>=2"] += 1
            g += accepted + 1
    print(f"features compared {checked} over {stops_agree} rounds, max |vLLM's - library's| {worst:.2e}")
    assert checked["committed k=1"] >= 3 and checked["committed k>=2"] >= 3, checked
    unnormed = copy.deepcopy(draft)
    unnormed.spec_config = {**draft.spec_config, "norm_output": False}
    head.attach(unnormed)
    wrong = SpeculativeDecoder(unnormed, target, SpecDecPP(head, HEAD_THRESHOLD, max_candidates=HEAD_K),
                               SamplingConfig(temperature=0))
    (_, right), (_, moved) = library_round(decoder, calls, first_prefix)[0], \
        library_round(wrong, calls, first_prefix)[0]
    head.attach(draft)
    print(f"with the pre-norm state: {(moved - right).abs().max():.2e}")
    assert (moved - right).abs().max() > 50 * 2e-4


def test_the_proposer_refuses_a_head_with_a_norm_output_false_draft(pair, tmp_path):
    """A bundle made without speculative_config's checks (a head beside a norm_output=false draft) is
    refused by the proposer as vLLM builds it: its loop would hand the head the final-normed state where
    the head reads the pre-norm one."""
    from specdecpp.vllm.config import write_bundle

    draft_dir = pair[1]
    unnormed = tmp_path / "unnormed"
    unnormed.mkdir()
    config = json.loads((draft_dir / "config.json").read_text())
    (unnormed / "config.json").write_text(json.dumps({**config, "norm_output": False}))
    (unnormed / "model.safetensors").symlink_to(draft_dir / "model.safetensors")
    bundle = write_bundle(unnormed, SpecDecPP(feature_head(unnormed), 0.5, max_candidates=HEAD_K), tmp_path / "b")
    with pytest.raises(Exception, match="a head with a feature draft of norm_output=false") as caught:
        close(start(pair[0], {"method": "eagle3", "model": str(bundle), "num_speculative_tokens": HEAD_K,
                              "draft_sample_method": "probabilistic"}))
    print(f"refused: {type(caught.value).__name__}")
