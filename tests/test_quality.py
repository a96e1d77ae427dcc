"""Quality on the real demo model (SmolLM2-135M-Instruct), greedy: does the output mean anything?

The shipped configs run as they are, on small inputs where meaning still holds, and the tests
assert floors set from measured numbers (in each test's docstring), well above chance. The
numbers are printed (`pytest -s`). The model is built once per session by the code behind
`overnight demo-model`, or taken from models/smollm2 when `make` has built it there
(conftest.py's ``smollm2``).
"""

from __future__ import annotations

import re

import polars as pl
import pytest

from pipelines import load_config, run_job
from conftest import REPO

# The product nouns of data/products.parquet whose category is not a matter of taste.
CATEGORY = {"desk lamp": "lighting", "wool scarf": "clothing", "cotton shirt": "clothing",
            "running shoe": "clothing", "steel bottle": "kitchen", "tea kettle": "kitchen",
            "leather bag": "bags", "backpack": "bags", "phone case": "electronics",
            "USB-C cable": "electronics", "oak chair": "furniture"}


@pytest.fixture(scope="session")
def run_shipped(smollm2, ray_cluster, tmp_path_factory):
    """Run a config from configs/ on the real model, with overrides; returns (summary, table)."""
    root = tmp_path_factory.mktemp("quality")

    def run(name: str, *overrides: str):
        out = root / name
        mp = pytest.MonkeyPatch()
        mp.chdir(REPO)  # the configs name their data and schemas relative to the repo
        try:
            config = load_config(REPO / "configs" / f"{name}.yaml",
                                 [f"model.name={smollm2}", f"output.path={out}", *overrides])
            return run_job(config), pl.read_parquet(out)
        finally:
            mp.undo()

    return run


def test_classify_reviews_accuracy(run_shipped):
    """240 labelled reviews (data/reviews_labelled.jsonl), 80 per label; chance is 1/3.
    Measured: 0.717 (positive 80/80, negative 80/80, mixed 12/80)."""
    summary, out = run_shipped("classify_reviews", "input.path=data/reviews_labelled.jsonl")
    assert out.height == 240 and out["error"].null_count() == 240
    hit = out["sentiment"] == out["label"]
    accuracy = hit.mean()
    by_label = out.with_columns(hit=hit).group_by("label", maintain_order=True).agg(
        pl.col("hit").mean())
    print(f"\nclassify_reviews: accuracy {accuracy:.3f} over {out.height} reviews; "
          f"by label {dict(by_label.iter_rows())}")
    assert accuracy >= 0.62
    # the clear-cut labels are where a 135M model is reliable
    clear = out.filter(pl.col("label") != "mixed")
    assert (clear["sentiment"] == clear["label"]).mean() >= 0.9
    # and its confidence says where it is not: measured, right on 0.81 of the 202 rows above
    # 0.5 and on 0.24 of the 38 at or below
    sure = out.with_columns(hit=hit).group_by(pl.col("confidence") > 0.5).agg(
        pl.col("hit").mean())
    accuracy_by = dict(sure.iter_rows())
    print(f"classify_reviews: accuracy where confidence > 0.5: {accuracy_by}")
    assert out["confidence"].is_between(0.0, 1.0).all()
    assert accuracy_by[True] - accuracy_by[False] >= 0.3


def test_extract_attributes_valid_and_grounded(run_shipped, tmp_path):
    """The first 60 products. Measured: 60/60 schema-valid; category as the product's noun
    says for 0.41 of the 56 whose noun decides it (chance 1/7), material found in the
    product's own title or description for 0.65."""
    products = pl.read_parquet(REPO / "data" / "products.parquet").head(60)
    path = tmp_path / "products60.parquet"
    products.write_parquet(path)
    summary, out = run_shipped("extract_attributes", f"input.path={path}")
    valid = (out["error"].is_null() & out["attributes"].is_not_null()).mean()

    attrs = out.unnest("attributes").with_columns(
        noun=pl.col("title").str.splitn(" ", 2).struct.field("field_1"))
    known = attrs.filter(pl.col("noun").is_in(list(CATEGORY)))
    category_ok = (known["category"] == known["noun"].replace_strict(CATEGORY)).mean()
    text = [f"{t} {d}".lower() for t, d in zip(attrs["title"], attrs["description"])]
    grounded = [bool(m) and all(w in txt for w in re.findall(r"\w+", m.lower()))
                for m, txt in zip(attrs["material"], text)]
    material_ok = sum(grounded) / len(grounded)
    print(f"\nextract_attributes: {valid:.3f} schema-valid; category agrees {category_ok:.3f} "
          f"({known.height} products); material in the row's text {material_ok:.3f}")
    assert valid == 1.0
    assert category_ok >= 0.3
    assert material_ok >= 0.5


def test_synthetic_qa_dedupe(run_shipped):
    """12 topics x 3 samples at temperature 0.3. Measured: no sample repeated an earlier one of
    its topic exactly, before dedupe or after; the share whose question alone repeats is
    printed beside it (exact dedupe keeps those)."""
    summary, out = run_shipped("synthetic_qa", "output.dedupe=true")
    total = 12 * 3
    before = summary.deduped / total
    after = 1 - out.group_by("topic_id").agg(pl.col("qa_json").n_unique())["qa_json"].sum() \
        / out.height
    across = 1 - out["qa_json"].n_unique() / out.height
    qa = out.unnest("qa")
    same_question = 1 - qa.group_by("topic_id").agg(pl.col("question").n_unique())[
        "question"].sum() / qa.height
    print(f"\nsynthetic_qa: duplicate rate {before:.3f} before dedupe ({summary.deduped}/{total}),"
          f" {after:.3f} after; {across:.3f} across topics after; question alone repeated "
          f"within its topic {same_question:.3f}")
    assert out.height == total - summary.deduped
    assert after == 0.0
    assert before < 0.5  # sampling still gives mostly distinct questions
    assert qa["question"].str.contains(r"\?").mean() >= 0.5  # they read as questions
