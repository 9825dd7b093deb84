"""Result file names: a method's tag comes from its settings() by one rule (infer.tags), and the
names of existing result files stay what they were (resume finds them)."""

import pytest

from infer.methods import method_config, resolve_method
from infer.tags import method_tag, result_path
from specdecpp import AcceptanceHead, SamplingConfig

# (method, settings over conf/method/<method>.yaml, the tag its result files have always had)
TAGS = [
    ("target_only", {}, "base"), ("oracle", {}, "oracle"),
    ("fixed_k", {}, "k4"), ("fixed_k", {"k": 12}, "k12"),
    ("svip", {}, "h0.3_c0.15_max40"), ("svip", {"threshold": 0.25, "c": 0.2, "max_candidates": 7}, "h0.25_c0.2_max7"),
    ("specdecpp", {"head": "HEADS/wrej12_d3"}, "wrej12_d3_h0.7_min1_max20"),
    ("specdecpp", {"head": "HEADS/next_wrej1_d1/", "threshold": 0.35, "min_candidates": 2, "max_candidates": 9},
     "next_wrej1_d1_h0.35_min2_max9"),
    ("hf_assisted", {}, "constant_n20"), ("hf_assisted", {"mode": "heuristic"}, "heuristic_n20"),
    ("hf_assisted", {"mode": "confidence", "confidence_threshold": 0.25}, "confidence_n20_c0.25"),
    ("pearl", {}, "gauto"), ("pearl", {"gamma": 4}, "g4"), ("pearl", {"num_threads": None}, "gauto_tNone"),
    ("pearl", {"stop": "svip", "threshold": 0.4, "c": 0.2}, "gauto_svip_h0.4_c0.2"),
    ("pearl", {"gamma": 3, "num_threads": 2, "stop": "svip"}, "g3_svip_h0.5_c0.15_t2"),
    ("pearl", {"stop": "specdecpp", "head": "HEADS/wrej12_d3", "threshold": 0.6, "num_threads": 2},
     "gauto_wrej12_d3_h0.6_t2"),
    ("sequoia", {}, "n6_d3_66c34e57"), ("sequoia", {"tree": [-1, 0, 0, 1]}, "n5_d4_cb85929b"),
    ("cascade", {}, "opt_a0.1_k4"), ("cascade", {"rule": "diff", "alpha": 0.5, "k": 3}, "diff_a0.5_k3"),
    ("cascade", {"rule": "chow", "alpha": 0.0, "k": 1}, "chow_a0_k1"),
    ("cascade", {"stop": "svip", "threshold": 0.45}, "opt_a0.1_svip_h0.45"),
    ("cascade", {"stop": "specdecpp", "head": "HEADS/next_wrej1_d1/", "threshold": 0.3, "rule": "token_v2",
                 "alpha": 0.05, "allow_label_mismatch": True}, "token_v2_a0.05_next_wrej1_d1_h0.3"),
    # the door: the tag of its policy's own method (in its own directory, results/.../hf_custom)
    ("hf_custom", {"stop": "fixed_k", "k": 2}, "k2"), ("hf_custom", {"stop": "svip"}, "svip_h0.3_c0.15_max40"),
    ("hf_custom", {"stop": "specdecpp", "head": "HEADS/next_wrej1_d1/", "threshold": 0.35},
     "next_wrej1_d1_h0.35_min1_max20"),
]


@pytest.fixture(scope="module")
def heads(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    for name in ("wrej12_d3", "next_wrej1_d1"):
        AcceptanceHead(tiny_pair.draft_hidden, 1, draft=tiny_pair.draft).save_pretrained(root / name)
    return root


@pytest.mark.parametrize("name, settings, tag", TAGS)
def test_tags_of_every_method_stay_the_same(tiny_pair, heads, name, settings, tag):
    settings = {k: v.replace("HEADS", str(heads)) if isinstance(v, str) else v for k, v in settings.items()}
    spec = resolve_method(method_config(name, settings), tiny_pair.draft, SamplingConfig(temperature=0))
    assert spec.tag == tag


def test_tag_rule_and_result_path():
    assert method_tag("fixed_k", {"k": 4, "unnamed_setting": 9}) == "k4"  # a setting without a prefix names no file
    assert method_tag("custom", {}) == "custom"
    assert method_tag("cascade", {"policy": {"k": 2}, "rule": "opt"}, ("rule", "policy.k")) == "opt_k2"
    greedy, sampled = SamplingConfig(temperature=0), SamplingConfig(temperature=1.0, top_k=50)
    assert result_path("out", "k4", greedy, 0).as_posix() == "out/k4__greedy__s0.jsonl"
    assert result_path("out", "k4", sampled, 1, batch_size=4, batch_fill=True).as_posix() == \
        "out/k4_b4_fill__t1-k50-p1__s1.jsonl"
