"""Issue 64 row 9: ``infer.report`` on result files with a cut or malformed line counts the rows it
can read and names each line it skipped (file and line number) in a warning and in report.md; a
fitted cost that is not positive (t_draft from fixed-K rows alone) is flagged in the report and
predicts nothing, and ``load_costs`` (``infer.potential --costs summary.json``) skips it."""

from __future__ import annotations

import json

import pytest

from infer.report import build_report
from specdecpp.analysis.costmodel import load_costs
from tests.apps.infer.test_report import _row


def _write(path, rows, tail: str = ""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def _base_and_k2(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        rows.append(_row("target_only", "base", {}, f"p{i}", 0, 20 + i, 20 + i, 0.05 * (20 + i)))
        rows.append(_row("fixed_k", "k2", {"k": 2}, f"p{i}", 2 * (8 + i), 8 + i, 20 + i,
                         0.01 * 2 * (8 + i) + 0.05 * (8 + i)))
    return rows


def test_cut_last_line_is_counted_and_named(tmp_path):
    rows = _base_and_k2(4)
    res = _write(tmp_path / "results" / "run.jsonl", rows,
                 json.dumps(_row("fixed_k", "k2", {"k": 2}, "p4", 24, 12, 24, 1.0))[:40])
    with pytest.warns(UserWarning, match=rf"(?s)^Skipped 1 result line, .*\n- `{res}` line 9: cut short"):
        report = build_report(res.parent, tmp_path / "report")
    assert report["skipped"] == [{"file": str(res), "line": 9, "problem": report["skipped"][0]["problem"]}]
    text = report["report"].read_text()
    assert (f"> **Skipped 1 result line**, not counted in any table (each is one prompt fewer in its table):\n"
            f"> - `{res}` line 9: cut short (the file's last line, with no newline") in text
    entries = {e["tag"]: e for e in report["groups"][0]["entries"]}
    assert entries["k2"]["n_prompts"] == 4 and entries["base"]["n_prompts"] == 4


def test_malformed_lines_inside_a_file_are_skipped_and_named(tmp_path):
    rows = _base_and_k2(3)
    res = tmp_path / "results" / "run.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines.insert(2, '{"method": "fixed_k", "n_generated": ')  # damage inside the file
    lines.insert(4, json.dumps({"method": "fixed_k", "prompt_id": "p9"}))  # a row without its counts
    lines.insert(5, "[1, 2]")
    res.parent.mkdir(parents=True)
    res.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match="Skipped 3 result lines"):
        report = build_report(res.parent, tmp_path / "report")
    assert [(s["line"], s["problem"].split(" (")[0]) for s in report["skipped"]] == [
        (3, "not valid JSON"), (5, "a result row without settings, pair, prompts, sampling, n_generated, n_draft, "
                                   "n_target, n_discarded, accept_lengths"), (6, "a JSON list, not a result row")]
    text = report["text"]
    assert "**Skipped 3 result lines**" in text and f"> - `{res}` line 5: a result row without settings" in text
    assert {e["tag"]: e["n_prompts"] for e in report["groups"][0]["entries"]} == {"base": 3, "k2": 3}


def test_nothing_readable_is_an_error_naming_the_lines(tmp_path):
    res = _write(tmp_path / "results" / "run.jsonl", [], '{"method": "fixed')
    with (pytest.warns(UserWarning),
          pytest.raises(ValueError, match=rf"(?s)no readable result rows .*`{res}` line 1: cut short")):
        build_report(res.parent, tmp_path / "report")


def test_fit_with_a_negative_cost_is_flagged_and_not_used(tmp_path):
    t_d, t_t = -0.0419, 0.2  # fixed-K rows alone: the least squares can land on a negative t_draft
    rows = []
    for i in range(3):
        for k, m in ((2, 10 + i), (4, 6 + i)):
            rows.append(_row("fixed_k", f"k{k}", {"k": k}, f"p{i}", k * m, m, 2 * m, t_d * k * m + t_t * m))
    res = _write(tmp_path / "results" / "run.jsonl", rows)
    report = build_report(res.parent, tmp_path / "report")
    (group,) = report["groups"]
    assert group["fit"]["t_draft"] == pytest.approx(t_d)
    assert group["fit_problem"].startswith("t_draft = -41.900 ms is not positive, which no forward costs: the 6 timed "
                                           "rows do not pin the two costs down")
    assert all(e["predicted_tokens_per_s"] is None and e["speedup_predicted"] is None for e in group["entries"])
    text = report["text"]
    assert ("t_draft = -41.900 ms, t_target = 200.000 ms, R^2 = 1.000.\n\n> **Flagged, not used: t_draft = -41.900 ms "
            "is not positive") in text and "t_draft / t_target" not in text
    with pytest.raises(ValueError, match=r"no fitted cost model with positive costs; its fits are flagged: t_draft = "
                                         r"-41\.900 ms is not positive"):
        load_costs(report["summary"])  # what infer.potential --costs summary.json reads


def test_fit_with_positive_costs_and_a_low_r2_is_used_with_the_warning(tmp_path):
    rows = []
    for i in range(6):  # exact Eq. 2.1 walls at 10 ms / 50 ms, every other prompt's doubled: R^2 < 0.9
        f = 2.0 if i % 2 else 1.0
        rows.append(_row("target_only", "base", {}, f"p{i}", 0, 20, 20, f * 0.05 * 20))
        rows.append(_row("fixed_k", "k2", {"k": 2}, f"p{i}", 16, 8, 20, f * (0.01 * 16 + 0.05 * 8)))
    report = build_report(_write(tmp_path / "results" / "run.jsonl", rows).parent, tmp_path / "report")
    (group,) = report["groups"]
    assert group["fit_problem"] is None and group["fit_warning"] and group["fit"]["r2"] < 0.9
    assert "Warning: R^2" in report["text"] and all(e["predicted_tokens_per_s"] for e in group["entries"])


def _potential(directory, mean_p: float, by_depth=None) -> None:
    directory.mkdir(parents=True)
    context = {"data": f"data/{directory.name}", "split": "dev", "prompts": 8, "positions": 600, "mean_p_acc": mean_p,
               "cost_ratio": 0.07, "cost_source": "measured", "best_lines": [f"fixed_k: best fixed_k k=2 at {mean_p}x"]}
    if by_depth:
        context["mean_p_acc_by_depth"] = by_depth
    (directory / "potential.json").write_text(json.dumps({"context": context, "records": []}))


def test_the_report_shows_each_pairs_potential_and_names_a_missing_one(tmp_path):
    """``--potential LABEL=DIR``: each pair's mean P (a feature draft's by depth) and best lines, in
    the order given; a directory without potential.json is an error naming it."""
    res = _write(tmp_path / "results" / "run.jsonl", _base_and_k2(4))
    _potential(tmp_path / "plain", 0.319)
    _potential(tmp_path / "feature", 0.341, [0.341, 0.323])
    text = build_report(res.parent, tmp_path / "report", potentials=[("plain (pair=demo)", tmp_path / "plain"),
                                                                     ("feature", tmp_path / "feature")])["text"]
    section = text[text.index("## The pairs by the potential tool"):]
    assert section.index("### plain (pair=demo)") < section.index("### feature")
    assert "mean P 0.319;" in section and "mean P 0.341, by depth 0.341 / 0.323;" in section
    assert "- fixed_k: best fixed_k k=2 at 0.341x" in section
    with pytest.raises(ValueError, match=r"--potential gone=.*gone: no potential.json there"):
        build_report(res.parent, tmp_path / "report2", potentials=[("gone", tmp_path / "gone")])
