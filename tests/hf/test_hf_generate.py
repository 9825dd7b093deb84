"""``specdecpp.hf``: transformers' ``generate(custom_generate=...)`` runs this project's decoders.

Greedy output equals plain greedy ``generate()`` token for token for every policy (target-only,
fixed K, SVIP, a saved head), with EOS of several ids, stop strings, a user's stopping criterion,
logits processors and max_new_tokens, one prompt and a left-padded batch of prompts of different
lengths; sampled output follows generate's own processed target distribution (chi-square against
the enumerated distribution of the first two tokens under temperature, top-k, top-p and a
repetition penalty); a TextIteratorStreamer yields the decoded output; the Hub folder loads from
its directory and matches the callable; bad input gets a clear error. Runs under transformers 5.x
and 4.56 (the documented kwargs form of the callable needs 4.57+ and says so)."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import pytest
import torch
from transformers import (
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    TextIteratorStreamer,
)
from transformers.generation import (
    GenerateDecoderOnlyOutput,
    StoppingCriteriaList,
    StopStringCriteria,
)

import specdecpp.hf as hf
from specdecpp import (
    SVIP,
    Cascade,
    FixedK,
    NextTokenHead,
    SamplingConfig,
    SpecDecPP,
    SpeculativeDecoder,
    TargetOnly,
    load_head,
)
from specdecpp.models.loading import load_model
from tests.helpers.paths import REPO
from tests.helpers.stats import chi_square_pvalue, sequence_distribution
from tests.helpers.tiny import build_tokenizer, noisy_copy, tiny_lm
from tests.models.test_graphs import graphs_on  # noqa: F401  (a fixture)

FOLDER = str(REPO / "hub" / "specdecpp-generate")
KWARGS_ROUTE = pytest.mark.skipif(not hasattr(GenerationMixin, "_extract_generation_mode_kwargs"),
                                  reason="transformers < 4.57 passes a custom_generate callable no extra keywords "
                                         "(bind them: functools.partial)")
PROMPTS = ["The quick brown", "def add(a, b):", "Write a short poem about"]
POLICIES = {
    "target_only": {"stop_policy": TargetOnly()},
    "fixed_k1": {"stop_policy": FixedK(1)},
    "fixed_k4": {"stop_policy": FixedK(4)},
    "svip": {"stop_policy": SVIP(threshold=0.4, max_candidates=6)},
    "head": {"head": "HEAD", "threshold": 0.5},
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and a draft close to it (both saved, loaded back by path, so the draft has a name), the
    shared tokenizer, and a lag-free head saved for this draft under greedy decoding."""
    root = tmp_path_factory.mktemp("hf_pair")
    tok = build_tokenizer()
    target = tiny_lm(len(tok), 32, 2, seed=31, scale=0.3)
    draft = noisy_copy(target, 0.15, seed=32)
    paths = {}
    for name, model in (("target", target), ("draft", draft)):
        for cfg in (model.config, model.generation_config):
            cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths[name] = str(root / name)
    head = NextTokenHead(32, depth=1, draft=paths["draft"])
    head.save_pretrained(root / "head", training={"dataset_meta": {"sampling": {"temperature": 0.0}}})
    return type("Pair", (), {"target": load_model(paths["target"], "cpu", "float32"),
                             "draft": load_model(paths["draft"], "cpu", "float32"), "tok": tok,
                             "head": str(root / "head"), "root": root})


def policy(pair, name: str) -> dict:
    return {k: (pair.head if v == "HEAD" else v) for k, v in POLICIES[name].items()}


def door(pair, **extra):
    """The callable with the extra keywords bound (every transformers version takes this form)."""
    return functools.partial(hf.generate, draft_model=pair.draft, **extra)


def encode(tok, text: str) -> torch.Tensor:
    return tok(text, return_tensors="pt").input_ids


def clean_tokens(tok, ids: list[int]) -> list[int]:
    """Positions of tokens that decode to printable ASCII words (stop strings the tokenizer round-trips)."""
    return [i for i, t in enumerate(ids) if (s := tok.decode([t])).isascii() and s.strip().isalnum()]


@pytest.mark.parametrize("name", list(POLICIES))
def test_greedy_equals_plain_generate_for_every_policy(pair, name):
    accepted = 0
    for text in PROMPTS:
        ids = encode(pair.tok, text)
        for n in (1, 7, 40):
            ref = pair.target.generate(ids, max_new_tokens=n, do_sample=False)
            out = pair.target.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                                       custom_generate=door(pair, **policy(pair, name)))
            assert out.sequences.tolist() == ref.tolist(), (text, n)
            accepted += sum(sum(s.accept_lengths) for s in out.run_stats)
    assert name == "target_only" or accepted > 0  # rounds with accepted candidates ran


@pytest.mark.parametrize("name", ["fixed_k4", "svip", "head"])
def test_generate_replays_captured_rounds_on_the_graph_backend(pair, name, graphs_on):  # noqa: F811
    """fast='graphs' through generate (the fake capture on a CPU, tests/models/test_graphs.py): with no
    logits processor beyond the sampling settings, the rounds are captured (specdecpp/decoders/captured.py)
    and the greedy output is still plain generate's; ``capture_rounds=False`` replays each forward alone,
    with the same output."""
    graphs_on("cpu")
    replayed = {True: 0, False: 0}
    for text in PROMPTS:
        ids = encode(pair.tok, text)
        ref = pair.target.generate(ids, max_new_tokens=24, do_sample=False)
        for capture in (True, False):
            out = pair.target.generate(ids, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                                       custom_generate=door(pair, fast="graphs", capture_rounds=capture,
                                                            **policy(pair, name)))
            assert out.sequences.tolist() == ref.tolist(), (text, capture)
            replayed[capture] += sum(s.replayed_rounds for s in out.run_stats)
    assert replayed[True] > 0 and replayed[False] == 0


@KWARGS_ROUTE
def test_the_documented_call_passes_the_keywords(pair):
    ids = encode(pair.tok, PROMPTS[0])
    ref = pair.target.generate(ids, max_new_tokens=30, do_sample=False)
    out = pair.target.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=hf.generate,
                               draft_model=pair.draft, head=pair.head, threshold=0.5, return_dict_in_generate=True)
    assert out.sequences.tolist() == ref.tolist()
    assert isinstance(out, GenerateDecoderOnlyOutput) and len(out.run_stats) == 1
    stats = out.run_stats[0]
    assert out.tokens_per_target_call == stats.n_generated / stats.n_target_calls > 1
    assert out.acceptance_rate == sum(stats.accept_lengths) / sum(stats.candidate_lengths)


@pytest.mark.parametrize("name", ["fixed_k4", "head"])
def test_greedy_stops_where_plain_generate_stops(pair, name):
    """EOS of several ids, processors that hold EOS back or reshape the scores, a stop string and a user's
    criterion: the output ends exactly where plain generate's does (tokens committed past the stop are cut)."""
    call = door(pair, **policy(pair, name))
    for text in PROMPTS:
        ids = encode(pair.tok, text)
        free = pair.target.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
        eos = [free[9], free[17]]  # two ids the target emits mid-way
        cases = [dict(eos_token_id=eos), dict(eos_token_id=eos, min_new_tokens=12),
                 dict(eos_token_id=eos, repetition_penalty=1.3, no_repeat_ngram_size=2),
                 dict(stopping_criteria=StoppingCriteriaList([LengthStop(ids.shape[1] + 13)]))]
        where = clean_tokens(pair.tok, free)
        if where:
            stop = [pair.tok.decode([free[where[len(where) // 2]]]).strip()]
            cases.append(dict(stopping_criteria=StoppingCriteriaList([StopStringCriteria(pair.tok, stop)])))
        for kw in cases:
            ref = pair.target.generate(ids, max_new_tokens=40, do_sample=False, **kw)
            out = pair.target.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=call, **kw)
            assert out.tolist() == ref.tolist(), (text, kw)


class LengthStop(StoppingCriteria):
    """A user's criterion: stop once the sequence holds ``length`` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def left_padded(tok, texts):
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    return batch.input_ids, batch.attention_mask


@pytest.mark.parametrize("name", ["fixed_k4", "svip", "head"])
def test_left_padded_batch_equals_plain_generate(pair, name):
    ids, mask = left_padded(pair.tok, PROMPTS + ["Give"])
    assert (mask == 0).any()  # prompts of different lengths
    free = pair.target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    eos = [free[0, ids.shape[1] + 6].item(), free[2, ids.shape[1] + 11].item()]
    for kw in (dict(), dict(eos_token_id=eos), dict(eos_token_id=eos, repetition_penalty=1.2, min_new_tokens=3),
               dict(stopping_criteria=StoppingCriteriaList([LengthStop(ids.shape[1] + 9)]))):
        ref = pair.target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, **kw)
        out = pair.target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                   custom_generate=door(pair, **policy(pair, name)), **kw)
        assert out.tolist() == ref.tolist(), kw


def test_output_scores_and_logits_are_plain_generates(pair):
    ids, mask = left_padded(pair.tok, PROMPTS[:2])
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, repetition_penalty=1.3,
              return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = pair.target.generate(ids, **kw)
    out = pair.target.generate(ids, custom_generate=door(pair, stop_policy=FixedK(3)), **kw)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert len(out.scores) == len(ref.scores) == len(out.logits)
    finished = (out.sequences[:, ids.shape[1]:] == pair.tok.pad_token_id).cumsum(1) > 0  # rows after their end
    for t, (a, b, la, lb) in enumerate(zip(out.scores, ref.scores, out.logits, ref.logits, strict=True)):
        live = ~finished[:, t]
        torch.testing.assert_close(a[live], b[live], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(la[live], lb[live], atol=1e-4, rtol=1e-4)


def processed_target(pair, prompt: torch.Tensor, **kw):
    """generate's own prepared processors for this call (captured by a custom_generate that returns them)."""
    return pair.target.generate(prompt,
                                custom_generate=lambda model, input_ids, logits_processor, **_: logits_processor,
                                **kw)


def test_sampled_output_follows_generates_processed_distribution(tiny_models):
    """Temperature, top-k, top-p and a repetition penalty (applied to both models), the first two tokens of
    1,500 decodes (a batch of 300 rows, five calls) against the exact distribution of generate's processors."""
    draft, target = tiny_models
    kw = dict(do_sample=True, temperature=0.8, top_k=6, top_p=0.9, repetition_penalty=1.5, max_new_tokens=2,
              pad_token_id=0)
    prompt = torch.tensor([[3, 1, 3]])
    processors = processed_target(type("P", (), {"target": target}), prompt, **kw)
    assert [type(p).__name__ for p in processors] == ["RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper",
                                                      "TopKLogitsWarper", "TopPLogitsWarper"]

    def next_probs(ids):
        scores = processors(torch.tensor([ids]), target(torch.tensor([ids])).logits[:, -1].float())
        return scores.softmax(-1)[0]

    expected = sequence_distribution(next_probs, prompt[0].tolist(), 2)
    call = functools.partial(hf.generate, draft_model=draft, stop_policy=FixedK(2))
    torch.manual_seed(0)
    samples, rejected = [], 0
    for _ in range(5):
        out = target.generate(prompt.expand(300, -1), custom_generate=call, return_dict_in_generate=True, **kw)
        samples += [tuple(row) for row in out.sequences[:, 3:].tolist()]
        rejected += sum(s.candidate_lengths[0] - s.accept_lengths[0] for s in out.run_stats)
    assert rejected > 100  # the draft's proposals were rejected often: the residual was sampled
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_global_rng_seeds_the_samples(pair):
    ids = encode(pair.tok, PROMPTS[0])
    call = door(pair, stop_policy=FixedK(3))

    def run(seed):
        torch.manual_seed(seed)
        return pair.target.generate(ids, max_new_tokens=20, do_sample=True, custom_generate=call).tolist()

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_same_seed_same_samples_as_the_decoder_called_directly(pair):
    """generate's preparation and loading the head inside the call draw nothing from the global RNG."""
    head = load_head(pair.head)
    decoder = SpeculativeDecoder(pair.draft, pair.target, SpecDecPP(head, 0.5), SamplingConfig(0.8, 20, 0.95))
    call = door(pair, head=pair.head, threshold=0.5, allow_sampling_mismatch=True)
    for seed, text in enumerate(PROMPTS):
        ids = encode(pair.tok, text)
        torch.manual_seed(seed)
        direct = decoder.generate(ids, max_new_tokens=20, eos_token_id=pair.tok.eos_token_id).tokens
        hf._load_head.cache_clear()  # the call loads the head itself
        torch.manual_seed(seed)
        out = pair.target.generate(ids, max_new_tokens=20, do_sample=True, temperature=0.8, top_k=20, top_p=0.95,
                                   custom_generate=call)
        assert out.tolist() == direct.tolist()


def stream(call_generate, tok):
    """The text a TextIteratorStreamer yields while ``call_generate(streamer)`` runs in a thread, and the output."""
    streamer, result = TextIteratorStreamer(tok, skip_prompt=True, timeout=60), {}

    def run():
        try:
            result["out"] = call_generate(streamer)
        except ValueError as exc:
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    text = "".join(streamer)  # ends when the decoder calls streamer.end()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return text, result.get("out", result.get("error"))


@pytest.mark.parametrize("route", ["callable", "folder"])
def test_streamer_yields_the_decoded_output(pair, route):
    ids = encode(pair.tok, PROMPTS[1])
    kw = dict(max_new_tokens=30, do_sample=False, draft_model=pair.draft, stop_policy=FixedK(3))
    if route == "callable":  # 5.x hands the callable no streamer; specdecpp.hf finds generate's
        kw = dict(max_new_tokens=30, do_sample=False, custom_generate=door(pair, stop_policy=FixedK(3)))
    else:
        kw.update(custom_generate=FOLDER, trust_remote_code=True)
    text, out = stream(lambda s: pair.target.generate(ids, streamer=s, **kw), pair.tok)
    assert out is not None and text == pair.tok.decode(out[0, ids.shape[1]:])
    assert out.tolist() == pair.target.generate(ids, max_new_tokens=30, do_sample=False).tolist()


def test_a_refused_call_still_ends_the_streamer(pair):
    ids = encode(pair.tok, PROMPTS[1])
    call = door(pair, stop_policy=FixedK(3))
    text, out = stream(lambda s: pair.target.generate(ids, streamer=s, max_new_tokens=5, do_sample=True, min_p=0.1,
                                                      custom_generate=call), pair.tok)
    assert isinstance(out, ValueError) and "MinPLogitsWarper" in str(out)
    assert text == ""  # the reader was released, not left waiting


def test_hub_folder_loads_and_matches_the_callable(pair):
    """From its local directory with trust_remote_code, with stop strings and the tokenizer (which
    transformers >= 4.57 hands a callable no more: the folder builds the stop-string criterion)."""
    for text in PROMPTS:
        ids = encode(pair.tok, text)
        free = pair.target.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
        where = clean_tokens(pair.tok, free)
        kw = dict(max_new_tokens=40, do_sample=False)
        if where:
            kw.update(stop_strings=[pair.tok.decode([free[where[0]]]).strip()], tokenizer=pair.tok)
        ref = pair.target.generate(ids, **kw)
        out = pair.target.generate(ids, custom_generate=FOLDER, trust_remote_code=True, draft_model=pair.draft,
                                   head=pair.head, threshold=0.5, **kw)
        assert out.tolist() == ref.tolist()
        criteria = [StopStringCriteria(pair.tok, kw["stop_strings"])] if where else []
        same = pair.target.generate(ids, max_new_tokens=40, do_sample=False,
                                    stopping_criteria=StoppingCriteriaList(criteria),
                                    custom_generate=door(pair, head=pair.head, threshold=0.5))
        assert out.tolist() == same.tolist()
    assert (Path(FOLDER) / "custom_generate" / "requirements.txt").is_file()


def test_hub_generate_called_directly(pair):
    ids, mask = left_padded(pair.tok, PROMPTS)
    ref = pair.target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    out = hf.hub_generate(pair.target, ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                          draft_model=pair.draft, stop_policy=FixedK(2))
    assert out.tolist() == ref.tolist()


class Shift(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + 1


@pytest.mark.parametrize("kw, match", [
    (dict(min_p=0.1, do_sample=True), "MinPLogitsWarper is not supported"),
    (dict(typical_p=0.5, do_sample=True), "TypicalLogitsWarper is not supported"),
    (dict(logits_processor=LogitsProcessorList([Shift()])), "Shift is not supported"),
    (dict(num_beams=2), "num_beams=2"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
])
def test_unsupported_settings_are_refused_by_name(pair, kw, match):
    ids = encode(pair.tok, PROMPTS[0])
    with pytest.raises(ValueError, match=match):
        pair.target.generate(ids, max_new_tokens=5, custom_generate=door(pair, stop_policy=FixedK(2)), **kw)


def test_bad_calls_get_clear_errors(pair, tmp_path, monkeypatch):
    ids = encode(pair.tok, PROMPTS[0])
    gen = functools.partial(pair.target.generate, ids, max_new_tokens=5)
    with pytest.raises(ValueError, match="needs draft_model"):
        gen(custom_generate=functools.partial(hf.generate, stop_policy=FixedK(2)))
    with pytest.raises(ValueError, match="needs a stop rule"):
        gen(custom_generate=door(pair))
    for bad in (1.5, -0.1):
        with pytest.raises(ValueError, match="threshold must be a number in"):
            gen(custom_generate=door(pair, head=pair.head, threshold=bad))
    with pytest.raises(ValueError, match="not both"):
        gen(custom_generate=door(pair, head=pair.head, stop_policy=FixedK(2)))
    other = NextTokenHead(48, depth=1, draft="some/other-draft")  # trained for another draft
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="does not match the configured draft"):
        gen(custom_generate=door(pair, head=str(tmp_path / "other")))
    renamed = NextTokenHead(32, depth=1, draft="some/other-draft")  # same size, another draft's name
    renamed.save_pretrained(tmp_path / "renamed")
    with pytest.raises(ValueError, match="allow_draft_mismatch"):
        gen(custom_generate=door(pair, head=str(tmp_path / "renamed")))
    gen(custom_generate=door(pair, head=str(tmp_path / "renamed"), allow_draft_mismatch=True))
    with pytest.raises(ValueError, match="trained on labels sampled under another setting"):  # a greedy head, sampled
        gen(do_sample=True, temperature=0.7, custom_generate=door(pair, head=pair.head))
    cascade = Cascade("opt", 0.1)  # the head learned the exact rule's acceptance, not the cascade's
    with pytest.raises(ValueError, match="trained on labels of exact min"):
        gen(custom_generate=door(pair, head=pair.head, cascade=cascade))
    gen(custom_generate=door(pair, head=pair.head, cascade=cascade, allow_label_mismatch=True))
    with pytest.raises(ValueError, match="stop_strings need the model's tokenizer"):
        hf.hub_generate(pair.target, ids, max_new_tokens=5, stop_strings=["a"], draft_model=pair.draft,
                        stop_policy=FixedK(2))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="could not be fetched"):
        gen(custom_generate=door(pair, head="no-such-org/no-such-head"))


def test_a_cascade_is_opt_in_and_runs_as_the_decoder_does(pair):
    """``cascade=`` decodes as ``SpeculativeDecoder(..., cascade=...)`` (lossy); with processors it is refused."""
    cascade = Cascade("opt", 0.1)
    decoder = SpeculativeDecoder(pair.draft, pair.target, FixedK(3), SamplingConfig(temperature=0), cascade=cascade)
    for text in PROMPTS:
        ids = encode(pair.tok, text)
        out = pair.target.generate(ids, max_new_tokens=20, do_sample=False,
                                   custom_generate=door(pair, stop_policy=FixedK(3), cascade=cascade))
        ref = decoder.generate(ids, max_new_tokens=20, eos_token_id=pair.tok.eos_token_id)
        assert out.tolist() == ref.tokens.tolist()
    with pytest.raises(ValueError, match="cannot run with the logits processors"):
        pair.target.generate(ids, max_new_tokens=5, repetition_penalty=1.2,
                             custom_generate=door(pair, stop_policy=FixedK(3), cascade=cascade))


def test_batch_errors(tiny_models, pair):
    draft, target = tiny_models  # no pad and no EOS token
    assert target.generation_config.pad_token_id is None and target.generation_config.eos_token_id is None
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="needs a pad token"):
        target.generate(ids, max_new_tokens=3, custom_generate=functools.partial(hf.generate, draft_model=draft,
                                                                                 stop_policy=FixedK(2)))
    ids, mask = left_padded(pair.tok, PROMPTS)
    text, out = stream(lambda s: pair.target.generate(ids, attention_mask=mask, max_new_tokens=3, streamer=s,
                                                      custom_generate=FOLDER, trust_remote_code=True,
                                                      draft_model=pair.draft, stop_policy=FixedK(2)), pair.tok)
    assert isinstance(out, ValueError)  # a streamer takes one row (transformers' own or ours says so)
    with pytest.raises(ValueError, match="not left-padded"):
        pair.target.generate(ids, attention_mask=mask.flip(1), max_new_tokens=3,
                             custom_generate=door(pair, stop_policy=FixedK(2)))


def test_a_head_is_fetched_by_hub_id(pair, monkeypatch):
    """``head="org/name"`` goes through huggingface_hub's snapshot_download (here: a local copy)."""
    asked = []

    def snapshot(repo_id, **kw):
        asked.append(repo_id)
        return pair.head

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot)
    assert load_head("my-org/my-head").draft == load_head(pair.head).draft and asked == ["my-org/my-head"]
    ids = encode(pair.tok, PROMPTS[2])
    out = pair.target.generate(ids, max_new_tokens=12, do_sample=False,
                               custom_generate=door(pair, head="my-org/my-head", threshold=0.5))
    assert out.tolist() == pair.target.generate(ids, max_new_tokens=12, do_sample=False).tolist()


@pytest.mark.gpu
def test_greedy_equals_plain_generate_on_cuda(pair):
    target, draft = pair.target.to("cuda"), pair.draft.to("cuda")
    try:
        ids, mask = left_padded(pair.tok, PROMPTS)
        one = encode(pair.tok, PROMPTS[0]).cuda()
        for name in POLICIES:
            call = functools.partial(hf.generate, draft_model=draft, **policy(pair, name))
            ref = target.generate(one, max_new_tokens=30, do_sample=False)
            out = target.generate(one, max_new_tokens=30, do_sample=False, custom_generate=call)
            assert out.tolist() == ref.tolist(), name
            ref = target.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=30, do_sample=False)
            out = target.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=30, do_sample=False,
                                  custom_generate=call)
            assert out.tolist() == ref.tolist(), name
    finally:
        pair.target.to("cpu"), pair.draft.to("cpu")


def test_minimum_length_processors_are_dropped_once_spent():
    """A minimum length the prompt already reaches changes no scores at any later prefix: the door
    drops it (generate builds one whenever min_length / min_new_tokens is set, even to 0); one still
    to reach is kept and applied."""
    from transformers.generation.logits_process import (
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    spent_len, live_len = MinLengthLogitsProcessor(5, eos_token_id=0), MinLengthLogitsProcessor(9, eos_token_id=0)
    spent_new = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=8, min_new_tokens=0, eos_token_id=0)
    live_new = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=8, min_new_tokens=3, eos_token_id=0)
    penalty = RepetitionPenaltyLogitsProcessor(1.3)
    kept = hf.drop_spent([spent_len, live_len, spent_new, live_new, penalty], width=8)
    assert kept == [live_len, live_new, penalty]
    scores, prefix = torch.randn(1, 6), torch.arange(8).unsqueeze(0) % 6
    for p in (spent_len, spent_new):  # what was dropped indeed changes nothing from the prompt on
        for extra in range(4):
            ids = torch.cat([prefix, torch.ones(1, extra, dtype=torch.long)], 1)
            assert torch.equal(p(ids, scores), scores)
