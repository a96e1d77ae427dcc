"""Regenerate the small tables in data/ that the demo and the shipped configs run on."""

import json
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq

ADJ = ["Soft", "Bright", "Compact", "Classic", "Modern", "Rugged", "Elegant", "Quiet", "Light",
       "Premium", "Handmade", "Vintage"]
NOUN = ["desk lamp", "wool scarf", "steel bottle", "leather bag", "cotton shirt", "phone case",
        "oak chair", "glass vase", "running shoe", "USB-C cable", "tea kettle", "backpack"]
EXTRA = ["Café-style finish.", "Naïve-art print.", "Über-durable.", "東京 design edition.",
         "Made for ☕ lovers 🙂.", "مرحبا — bilingual label.", "שלום gift box.",
         "Ships in 2–3 days.", ""]
BRANDS = ["Acme", "Nordlys", "Kōbō", "Zephyr", None]


def make(n: int = 300, seed: int = 7) -> pa.Table:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        adj, noun = rng.choice(ADJ), rng.choice(NOUN)
        desc = (f"A {adj.lower()} {noun} for everyday use. "
                f"{rng.choice(['Easy to clean.', 'Fits in any room.', 'Built to last.', ''])} "
                f"{rng.choice(EXTRA)}").strip()
        rows.append({
            "sku": f"SKU-{i + 1:05d}",
            "title": f"{adj} {noun}",
            "description": desc,
            "price": None if rng.random() < 0.1 else round(rng.uniform(3, 250), 2),
            "brand": rng.choice(BRANDS),
            "in_stock": rng.random() < 0.8,
        })
    return pa.Table.from_pylist(rows)


REVIEW_BITS = ["Love it", "Broke after a week", "Does the job", "Too expensive",
               "Exactly as described", "Arrived late, works fine", "Meh", "Would buy again 👍",
               "Ne marche pas", "Sehr gut"]
TOPICS = ["photosynthesis", "the French revolution", "binary search", "tectonic plates",
          "compound interest", "the water cycle", "TCP handshakes", "vaccines", "black holes",
          "supply and demand", "prime numbers", "the Silk Road"]


def reviews(n: int = 60, seed: int = 11) -> list[dict]:
    rng = random.Random(seed)
    return [{"review_id": i, "product": rng.choice(NOUN),
             "text": f"{rng.choice(REVIEW_BITS)}. {rng.choice(REVIEW_BITS)}.",
             "stars": rng.randint(1, 5)} for i in range(n)]


def topics() -> list[dict]:
    return [{"topic_id": f"T{i:02d}", "topic": t, "level": ["school", "college"][i % 2]}
            for i, t in enumerate(TOPICS)]


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "data"
    pq.write_table(make(), f"{out}/products.parquet")
    write_jsonl(reviews(), f"{out}/reviews.jsonl")
    write_jsonl(topics(), f"{out}/topics.jsonl")
    print(out)
