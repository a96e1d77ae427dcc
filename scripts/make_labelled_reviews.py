"""Write data/reviews_labelled.jsonl: customer reviews with a known sentiment, for the quality test.

Each review is built from templates so that its label is clear to a human reader: `positive`
praises the product, `negative` complains, `mixed` praises one thing and complains of another.
The phrasing varies (openers, aspects, products, lengths, the order of praise and complaint) so
that no single word gives the label away. Seeded: the same command writes the same file.

    python scripts/make_labelled_reviews.py [OUT]    # default data/reviews_labelled.jsonl
"""

import json
import random
import sys

PRODUCTS = ["desk lamp", "wool scarf", "steel bottle", "leather bag", "cotton shirt",
            "phone case", "oak chair", "glass vase", "running shoe", "USB-C cable", "tea kettle",
            "backpack", "blender", "headphones", "rain jacket", "coffee mug"]

PRAISE = [
    "I love this {p}.", "This {p} is excellent.", "Absolutely fantastic {p}.",
    "Best {p} I have ever owned.", "The {p} works perfectly.", "Great quality, very happy.",
    "It exceeded my expectations.", "Beautiful and well made.", "Highly recommended!",
    "Five stars, would buy again.", "My wife loves it.", "Superb value for the money.",
    "The {p} feels solid and sturdy.", "Arrived quickly and works great.",
    "Wonderful product, no complaints at all.", "Exactly what I wanted.",
]
COMPLAINT = [
    "I hate this {p}.", "This {p} is terrible.", "It broke after two days.",
    "Worst {p} I have ever bought.", "The {p} stopped working within a week.",
    "Cheap, flimsy and badly made.", "Complete waste of money.", "Do not buy this.",
    "It arrived damaged and support never replied.", "Very disappointed.",
    "The {p} fell apart on first use.", "Awful quality, I returned it.",
    "One star. It does not work.", "Useless, it leaks everywhere.",
    "Totally unreliable and overpriced.", "I regret buying this {p}.",
]
# Mixed: one good aspect and one bad aspect of the same product.
GOOD_ASPECT = ["the color is lovely", "it looks great", "the price was fair",
               "it is comfortable", "shipping was fast", "the design is nice",
               "it is very light", "the material feels good"]
BAD_ASPECT = ["it broke after a month", "the battery dies quickly", "it is too small",
              "the zipper is weak", "it scratches easily", "the instructions were useless",
              "it is quite noisy", "the strap snapped"]
MIXED = [
    "{Good}, but {bad}.", "{Bad}, but {good}.", "The {p} is okay: {good}, however {bad}.",
    "Mixed feelings about this {p}. {Good}, but {bad}.", "{Good}. On the other hand, {bad}.",
    "Some good, some bad: {good}, yet {bad}.",
]
LABELS = ["positive", "negative", "mixed"]


def make(n: int = 240, seed: int = 19) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = LABELS[i % 3]
        p = rng.choice(PRODUCTS)
        if label == "mixed":
            good, bad = rng.choice(GOOD_ASPECT), rng.choice(BAD_ASPECT)
            text = rng.choice(MIXED).format(p=p, good=good, bad=bad, Good=good.capitalize(),
                                            Bad=bad.capitalize())
        else:
            pool = PRAISE if label == "positive" else COMPLAINT
            text = " ".join(s.format(p=p) for s in rng.sample(pool, rng.choice([1, 2, 2, 3])))
        rows.append({"review_id": i, "product": p, "text": text, "label": label})
    rng.shuffle(rows)
    return [{**row, "review_id": i} for i, row in enumerate(rows)]


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "data/reviews_labelled.jsonl"
    with open(out, "w", encoding="utf-8") as handle:
        for row in make():
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(out)
