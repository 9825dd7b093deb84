"""Prompt sources (bundled splits, local JSONL, offline fallbacks) and chat-template encoding."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdecpp.data import prompts as prompts_module
from specdecpp.data.prompts import (
    ALPACA_SPLIT_SIZES,
    SOURCES,
    Prompt,
    bundled_rows,
    encode_prompt,
    load_prompts,
)
from tests.helpers.paths import CONF
from tests.helpers.tiny import build_tokenizer

SPLITS = ("train", "dev", "test")


@pytest.fixture
def offline(monkeypatch):
    """No test may contact the hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def chat_tokenizer():
    """The tokenizer of the ``tiny_pair`` fixture (chat template, EOS), without building models."""
    return build_tokenizer()


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- bundled


def test_bundled_splits_partition_the_file_deterministically():
    rows = bundled_rows()
    assert len(rows) >= 300
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    splits = {s: load_prompts("bundled", s) for s in SPLITS}
    split_ids = {s: [p.id for p in ps] for s, ps in splits.items()}
    for s in SPLITS:
        assert len(set(split_ids[s])) == len(split_ids[s])
    assert set(split_ids["train"]).isdisjoint(split_ids["dev"])
    assert set(split_ids["train"]).isdisjoint(split_ids["test"])
    assert set(split_ids["dev"]).isdisjoint(split_ids["test"])
    assert sorted(sum(split_ids.values(), [])) == sorted(ids)
    assert len(splits["test"]) >= 50
    n = len(rows)
    assert abs(len(splits["train"]) / n - 0.7) < 0.03 and abs(len(splits["test"]) / n - 0.2) < 0.03
    # the same call twice gives the same prompts in the same (file) order
    assert load_prompts("bundled", "test") == splits["test"]
    assert split_ids["test"] == sorted(split_ids["test"])
    text = {r["id"]: r["prompt"] for r in rows}
    assert all(p.prompt == text[p.id] for p in splits["dev"])


def test_bundled_every_category_in_every_split():
    category = {r["id"]: r["category"] for r in bundled_rows()}
    all_categories = set(category.values())
    assert len(all_categories) >= 8
    for s in SPLITS:
        counts = Counter(category[p.id] for p in load_prompts("bundled", s))
        assert set(counts) == all_categories, s


def test_bundled_prompts_are_clean_and_varied():
    rows = bundled_rows()
    texts = [r["prompt"] for r in rows]
    assert len(set(texts)) == len(texts)
    assert all(t == t.strip() and t for t in texts)
    words = [len(t.split()) for t in texts]
    assert min(words) < 10 and max(words) > 40


def test_limit_takes_the_first_prompts_and_rejects_bad_values():
    test = load_prompts("bundled", "test")
    assert load_prompts("bundled", "test", limit=5) == test[:5]
    assert load_prompts("bundled", "test", limit=len(test)) == test
    with pytest.raises(ValueError, match=rf"limit={len(test) + 1}.*{len(test)} prompts"):
        load_prompts("bundled", "test", limit=len(test) + 1)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="limit"):
            load_prompts("bundled", "test", limit=bad)


def test_unknown_source_and_split_are_named():
    with pytest.raises(ValueError, match="'wiki'.*bundled, alpaca, humaneval, gsm8k, jsonl"):
        load_prompts("wiki")
    with pytest.raises(ValueError, match="no split 'validation'.*train, dev, test"):
        load_prompts("bundled", "validation")


def test_prompt_is_frozen():
    p = Prompt("a", "b")
    with pytest.raises(AttributeError):
        p.prompt = "c"


# ---------------------------------------------------------------- jsonl


def test_jsonl_skips_malformed_lines_with_one_counting_warning(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [
        json.dumps({"id": "a", "prompt": "First prompt."}),
        "",
        "{not json",
        json.dumps({"id": "b", "prompt": "   "}),
        json.dumps({"id": "c", "prompt": 42}),
        json.dumps({"id": "d"}),
        json.dumps(["a list", "not an object"]),
        json.dumps({"prompt": "No id here."}),
        json.dumps({"id": 7, "prompt": "Numeric id."}),
    ])
    with pytest.warns(UserWarning) as record:
        prompts = load_prompts("jsonl", path=path)
    messages = [str(w.message) for w in record if "p.jsonl" in str(w.message)]
    assert len(messages) == 1
    assert "skipped 5 malformed line(s) (line 3, 4, 5, 6, 7)" in messages[0]
    assert "1 blank line(s)" in messages[0]
    assert prompts == [Prompt("a", "First prompt."), Prompt("line-8", "No id here."),
                       Prompt("7", "Numeric id.")]


def test_jsonl_skips_a_line_that_is_not_utf8_naming_file_and_line(tmp_path):
    """Issue 64 row 3: one line of invalid UTF-8 is skipped with the warning docs/prompts.md
    promises (file and line named); the other lines are kept. A UTF-8 BOM is not an error."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "a", "prompt": "First."}).encode() + b"\n"
                     + b'{"id": "b", "prompt": "caf\xe9 au lait"}\n'  # Latin-1, not UTF-8
                     + json.dumps({"id": "c", "prompt": "Caf\u00e9 cr\u00e8me."}).encode() + b"\n")
    with pytest.warns(UserWarning) as record:
        prompts = load_prompts("jsonl", path=path)
    messages = [str(w.message) for w in record if "p.jsonl" in str(w.message)]
    assert len(messages) == 1
    assert f"prompts file {str(path)!r}: skipped 0 malformed line(s), 1 line(s) that are not valid UTF-8 " \
           "(line 2) and 0 blank line(s)" in messages[0]
    assert prompts == [Prompt("a", "First."), Prompt("c", "Caf\u00e9 cr\u00e8me.")]


def test_prompt_digest_and_the_context_check(tmp_path):
    """The digest resumes compare (id and text), and the long-prompt check of data_gen and infer."""
    from specdecpp.data.prompts import context_limit, prompt_digest, too_long

    assert prompt_digest(Prompt("a", "x")) == prompt_digest(Prompt("a", "x", answer="1"))
    assert len({prompt_digest(Prompt("a", "x")), prompt_digest(Prompt("a", "y")), prompt_digest(Prompt("b", "x"))}) == 3
    limit, source = context_limit(draft=type("C", (), {"max_position_embeddings": 8192})(),
                                  target=type("C", (), {"max_position_embeddings": 4096})())
    assert (limit, source) == (4096, "max_position_embeddings of the target")
    assert context_limit(target=object()) == (None, "")
    assert too_long({"p": 10_004, "q": 20}, 128, None, "") == {}  # no limit known
    with pytest.raises(ValueError, match=r"prompts: prompt 'p' is 10004 tokens long \(chat template applied\); with "
                                         r"max_new_tokens=128 it needs 10132 positions, more than the pair's context "
                                         r"of 4096 \(max_position_embeddings of the target\)\. .*long_prompts=skip"):
        too_long({"q": 20, "p": 10_004}, 128, limit, source)
    with pytest.warns(UserWarning, match=r"skipping 1 prompt\(s\) .*'p' \(10004 tokens\)"):
        assert too_long({"q": 20, "p": 10_004}, 128, limit, source, "skip") == {"p": 10_004}
    assert too_long({"q": 3968}, 128, limit, source) == {}  # exactly fits


def test_jsonl_clean_file_gives_no_warning(tmp_path, recwarn):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"id": f"q{i}", "prompt": f"Prompt {i}"})
                                              for i in range(4)])
    assert [p.id for p in load_prompts("jsonl", path=str(path), limit=3)] == ["q0", "q1", "q2"]
    assert not [w for w in recwarn if "p.jsonl" in str(w.message)]


def test_jsonl_errors(tmp_path):
    with pytest.raises(ValueError, match="needs a file.*prompts.path"):
        load_prompts("jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompts("jsonl", path=tmp_path / "missing.jsonl")
    dup = write_lines(tmp_path / "dup.jsonl", [json.dumps({"id": "x", "prompt": "one"}),
                                               json.dumps({"id": "y", "prompt": "two"}),
                                               json.dumps({"id": "x", "prompt": "three"})])
    with pytest.raises(ValueError, match=r"id 'x' is used twice \(lines 1 and 3\)"):
        load_prompts("jsonl", path=dup)
    empty = write_lines(tmp_path / "bad.jsonl", ["", "[]", '{"id": "z"}'])
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no valid prompt"):
        load_prompts("jsonl", path=empty)


def test_jsonl_split_field_selects_rows(tmp_path):
    path = write_lines(tmp_path / "s.jsonl", [
        json.dumps({"id": "t1", "prompt": "train one", "split": "train"}),
        json.dumps({"id": "e1", "prompt": "test one", "split": "test"}),
        json.dumps({"id": "t2", "prompt": "train two", "split": "train"}),
    ])
    assert [p.id for p in load_prompts("jsonl", "train", path=path)] == ["t1", "t2"]
    assert [p.id for p in load_prompts("jsonl", "test", path=path)] == ["e1"]
    assert [p.id for p in load_prompts("jsonl", None, path=path)] == ["t1", "e1", "t2"]
    with pytest.raises(ValueError, match="no rows with split 'dev'.*test, train"):
        load_prompts("jsonl", "dev", path=path)


# ---------------------------------------------------------------- hub sources, offline


def test_humaneval_falls_back_to_the_package_offline(offline):
    start = time.perf_counter()
    prompts = load_prompts("humaneval")
    assert time.perf_counter() - start < 5
    assert len(prompts) == 164
    assert [p.id for p in prompts] == [f"HumanEval/{i}" for i in range(164)]
    assert prompts[0].prompt.startswith("from typing import List")
    assert all("def " in p.prompt for p in prompts)
    assert load_prompts("humaneval", limit=10) == prompts[:10]
    with pytest.raises(ValueError, match="no split 'train'"):
        load_prompts("humaneval", "train")


def test_unreachable_hub_is_detected_quickly_without_offline_flag(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    start = time.perf_counter()
    assert not prompts_module.hub_reachable()
    assert time.perf_counter() - start < 5
    monkeypatch.setattr(prompts_module, "hub_reachable", lambda: False)
    assert [p.id for p in load_prompts("humaneval", limit=2)] == ["HumanEval/0", "HumanEval/1"]


@pytest.mark.parametrize("source", ["alpaca", "gsm8k"])
def test_hub_only_sources_fail_fast_and_clearly_offline(offline, source):
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match=rf"'{source}'.*prompts=bundled.*prompts=jsonl"):
        load_prompts(source)
    assert time.perf_counter() - start < 5


def test_alpaca_split_from_a_local_copy(offline, tmp_path):
    n = sum(ALPACA_SPLIT_SIZES.values()) + 2  # the hub copy has 52,002 rows
    path = tmp_path / "alpaca.jsonl"
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"instruction": f"Task {i}.", "input": f"Context {i}." if i % 2 else "",
                                 "output": "x"}) + "\n")
    splits = {s: load_prompts("alpaca", s, path=path) for s in SPLITS}
    assert {s: len(p) for s, p in splits.items()} == ALPACA_SPLIT_SIZES
    ids = [p.id for ps in splits.values() for p in ps]
    assert len(set(ids)) == len(ids)
    import numpy as np
    order = np.random.default_rng(0).permutation(n)
    assert [p.id for p in splits["test"][:3]] == [f"alpaca-{i}" for i in order[50_000:50_003]]
    for p in splits["test"]:
        i = int(p.id.split("-")[1])
        assert p.prompt == (f"Task {i}.\n\nContext {i}." if i % 2 else f"Task {i}.")
    assert load_prompts("alpaca", "test", limit=7, path=path) == splits["test"][:7]


def test_gsm8k_from_a_local_copy(offline, tmp_path):
    (tmp_path / "main").mkdir()
    with open(tmp_path / "main" / "test.jsonl", "w") as fh:
        for i in range(3):
            fh.write(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n")
    prompts = load_prompts("gsm8k", "test", path=tmp_path)
    assert prompts == [Prompt(f"gsm8k-test-{i}", f"What is {i} + {i}?", str(2 * i)) for i in range(3)]


# ---------------------------------------------------------------- configs and encoding


@pytest.mark.parametrize("name", SOURCES)
def test_prompt_configs_compose(name):
    with initialize_config_dir(config_dir=str(CONF / "prompts"), version_base="1.3"):
        cfg = compose(config_name=name)
    assert set(cfg) == {"name", "source", "split", "limit", "path"}
    assert cfg.name == name and cfg.source == name and cfg.split == "test"
    assert cfg.limit is None and cfg.path is None


def test_encode_prompt_applies_the_chat_template(chat_tokenizer):
    tok = chat_tokenizer
    ids = encode_prompt(tok, "Explain recursion.")
    expected = "<|im_start|>user\nExplain recursion.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == expected
    assert ids == tok(expected, add_special_tokens=False).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    assert all(isinstance(i, int) for i in ids)


def test_encode_prompt_without_template_is_plain_encoding(chat_tokenizer):
    tok = chat_tokenizer
    plain = tok.__class__(tokenizer_object=tok.backend_tokenizer)
    assert not plain.chat_template
    assert encode_prompt(plain, "Explain recursion.") == plain("Explain recursion.").input_ids


@pytest.mark.parametrize("text", ["", "   ", "\n\t", None])
def test_encode_prompt_rejects_empty(chat_tokenizer, text):
    with pytest.raises(ValueError, match="empty prompt"):
        encode_prompt(chat_tokenizer, text)
