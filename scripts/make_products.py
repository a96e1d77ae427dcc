"""Regenerate data/products.parquet, the demo's product table (deterministic)."""

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


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "data/products.parquet"
    pq.write_table(make(), out)
    print(out)
