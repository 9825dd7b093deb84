"""method=hf_custom: the decoder through ``target.generate(custom_generate=specdecpp.hf.generate,
...)`` beside the direct decoder with the same policy, interleaved, on the tiny pair: the same
tokens as the direct rows (greedy, and sampled: the door draws from the global generator seeded
as the direct decoder seeds its own), the same rounds, the method's tag and settings, timed rows;
the report pairs the two; bad settings fail before any model loads. Tags: test_infer_tags.py; the
report on synthetic rows: test_report.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import infer.app as app
from infer import sweep
from infer.report import build_report
from infer.results import read_rows
from specdecpp import AcceptanceHead
from tests.apps.infer.test_infer import no_model_loading  # noqa: F401 (the fixture)
from tests.helpers.infer import make_cfg

MAX_NEW = 8
STATS = ("n_generated", "n_target", "n_draft", "n_discarded", "accept_lengths", "candidate_lengths")


@pytest.fixture(scope="module")
def setup(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_custom")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"id": "sea", "prompt": "Write a short poem about the sea."}\n'
                       '{"id": "math", "prompt": "What is 12 times 7?"}\n'
                       '{"id": "code", "prompt": "def add(a, b):"}\n')
    head = root / "head"
    AcceptanceHead(tiny_pair.draft_hidden, 1, draft=tiny_pair.draft).save_pretrained(head)
    base = [f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "prompts=jsonl",
            f"prompts.path={prompts}", f"max_new_tokens={MAX_NEW}", "warmup_tokens=2", "progress=false"]
    comparison = ("'+comparison={fixed_k: {k: 2}, svip: {threshold: 0.5}, specdecpp: {head: HEAD, threshold: 0.5}, "
                  "hf_custom: [{stop: fixed_k, k: 2}, {stop: svip, threshold: 0.5}, "
                  "{stop: specdecpp, head: HEAD, threshold: 0.5}]}'").replace("HEAD", str(head)).strip("'")
    return type("Setup", (), {"root": root, "head": head, "base": base, "comparison": comparison})


def _run(setup, sampling: str) -> dict:
    out = setup.root / sampling
    summaries = sweep.run(make_cfg(*setup.base, f"sampling={sampling}", "interleave=true", "~comparison",
                                   setup.comparison, f"out={out}/${{method.name}}"))
    return {(s["method"], s["tag"]): read_rows(Path(s["path"])) for s in summaries}


@pytest.mark.parametrize("sampling", ["greedy", "paper"])
def test_hf_custom_rows_equal_the_direct_decoders_rows(setup, sampling, monkeypatch):
    import specdecpp.hf

    built, split = [], specdecpp.hf.split_processors
    monkeypatch.setattr(specdecpp.hf, "split_processors",
                        lambda processors, *a: built.append({type(p).__name__ for p in processors})
                        or split(processors, *a))
    runs = _run(setup, sampling)
    # generate builds the sampling warpers and nothing else (no no-op processor the door would apply per position)
    assert built and all(b == (set() if sampling == "greedy" else {"TopKLogitsWarper"}) for b in built), built
    door = {key: rows for key, rows in runs.items() if key[0] == "hf_custom"}
    assert sorted(tag for _, tag in door) == ["head_h0.5_min1_max20", "k2", "svip_h0.5_c0.15_max40"]
    for (_, tag), rows in door.items():
        stop = rows[0]["settings"]["stop"]
        direct = runs[stop, tag.removeprefix("svip_")]  # the direct run with the same policy: the same tag
        assert rows[0]["settings"] == {"stop": stop, **direct[0]["settings"]}
        assert [r["prompt_id"] for r in rows] == [r["prompt_id"] for r in direct] == ["sea", "math", "code"]
        for r, d in zip(rows, direct, strict=True):
            assert r["method"] == "hf_custom" and r["tag"] == tag and r["timed"]
            assert r["output_ids"] == d["output_ids"], (tag, r["prompt_id"])  # token for token
            assert {k: r[k] for k in STATS} == {k: d[k] for k in STATS}, (tag, r["prompt_id"])  # the same rounds
            assert r["n_generated"] == len(r["output_ids"]) == MAX_NEW
            assert r["n_draft"] + r["n_target"] == r["n_generated"] + r["n_discarded"]  # Eq. 2.1 identity
            # the wall time is taken around generate: its preparation and the decoder's own time inside it
            assert 0 < r["door_inner_wall_time_s"] < r["wall_time_s"] and 0 < r["forward_time_s"] < r["wall_time_s"]
            assert r["tokens_per_s"] == pytest.approx(r["n_generated"] / r["wall_time_s"])
    report = build_report(setup.root / sampling, setup.root / f"report_{sampling}")
    entries = {(e["method"], e["tag"]): e for e in report["groups"][0]["entries"]}
    for key in door:
        v = entries[key]["vs_direct"]
        assert (v["same_tokens"], v["n_compared"], v["ci_n"]) == (3, 3, 3) and v["ratio"] > 0
    assert "k2: " in report["text"] and "over fixed_k k2" in report["text"]


@pytest.mark.usefixtures("no_model_loading")
def test_hf_custom_bad_settings_fail_before_loading(setup, tiny_pair, tmp_path):
    base = [*setup.base, "method=hf_custom", f"out={tmp_path}"]
    with pytest.raises(ValueError, match="hf_custom: stop must be one of fixed_k, svip, specdecpp, got 'pearl'"):
        app.run(make_cfg(*base, "method.stop=pearl"))
    with pytest.raises(ValueError, match=r"hf_custom: stop=fixed_k has no setting c, threshold \(conf/method/fixed_k"
                                         r".yaml has k\)"):
        app.run(make_cfg(*base, "method.stop=fixed_k", "method.threshold=0.5", "method.c=0.2"))
    with pytest.raises(ValueError, match=r"^SVIP: threshold must be a number in \[0, 1\], got 1.5"):  # the policy's own
        app.run(make_cfg(*base, "method.stop=svip", "method.threshold=1.5"))
    renamed = tmp_path / "head_other_draft"
    AcceptanceHead(8, 1, draft="someone/other-draft").save_pretrained(renamed)
    with pytest.raises(ValueError, match="allow_draft_mismatch"):  # the head checks of method=specdecpp
        app.run(make_cfg(*base, "method.stop=specdecpp", f"method.head={renamed}"))
    with pytest.raises(ValueError, match="method=hf_custom decodes one prompt at a time"):
        app.run(make_cfg(*base, "method.stop=fixed_k", "batch_size=2"))
    head = tmp_path / "head_with_pair"
    AcceptanceHead(tiny_pair.draft_hidden, 1, draft=tiny_pair.draft).save_pretrained(head, target=tiny_pair.target)
    job = app.prepare(make_cfg(*[o for o in base if not o.startswith("pair.")], "method.stop=specdecpp",
                               f"method.head={head}"))  # no pair.*: the head's, as under method=specdecpp
    assert (job.pair["draft"], job.pair["target"]) == (tiny_pair.draft, tiny_pair.target)
    assert job.spec.head.draft == tiny_pair.draft and job.spec.settings["stop"] == "specdecpp"


def test_hf_custom_passes_the_allow_switches_to_the_doors_head_check(setup, tiny_pair, tmp_path):
    """A head trained under sampling, decoding greedily: refused by infer's check without
    method.allow_sampling_mismatch, and with it the door (which checks the head again) decodes."""
    sampled = tmp_path / "head_t1_k50"
    AcceptanceHead(tiny_pair.draft_hidden, 1, draft=tiny_pair.draft).save_pretrained(
        sampled, training={"dataset_meta": {"sampling": {"temperature": 1.0, "top_k": 50, "top_p": 1.0}}})
    base = [*setup.base, "method=hf_custom", "method.stop=specdecpp", f"method.head={sampled}", "sampling=greedy",
            "prompts.limit=1", "max_new_tokens=3", f"out={tmp_path}/out"]
    with pytest.raises(ValueError, match="method.allow_sampling_mismatch=true"):
        app.run(make_cfg(*base))
    rows = read_rows(Path(app.run(make_cfg(*base, "method.allow_sampling_mismatch=true"))["path"]))
    assert [(r["method"], r["n_generated"]) for r in rows] == [("hf_custom", 3)]
