"""Logprobs as a column, and a classifier's confidence read from them.

The logprobs column holds, for each generated token, the token, its logprob and the top K
alternatives: ``list<struct<token, token_id, logprob: float32, top: list<struct<token,
token_id, logprob>>>>``. A list of structs, not parallel lists, so that one token's numbers
travel together through Polars/pandas (``explode`` then ``unnest``); float32 because vLLM
computes logprobs in float32, so a wider type would store no more; ``token_id`` because a
token's text alone can be ambiguous (two ids, one text; a UTF-8 character split over
tokens), and is null from an OpenAI server, which returns text only.

``confidence`` is for ``structured.choice``: the probability of the chosen label among the
allowed labels, from the logprobs of the same generation. vLLM applies the grammar's mask to
the logits before it computes logprobs (vllm/v1/worker/gpu_model_runner.py: the bitmask, then
the sampler, whose default ``raw_logprobs`` are taken from those logits), so at each step
the tokens the grammar allows share all the probability, in the model's own ratios (before
temperature and penalties). The grammar lets a label be spelled by any tokens that make up
its text, and a random-weight model does take 'p', 'o', 's' for "positive", so labels are
followed as text, not as token ids: at each step, the probability a label keeps is the
share of the allowed tokens that continue towards it (once its text is complete, the share
that ends there). A label's mass is the product of those shares along the generated path,
up to the step that rules it out; the masses, normalized over the labels, are the
confidences. For labels that part at one step (two labels, or labels with distinct first
characters) the masses sum to 1 before normalizing: at the parting step the allowed tokens
split between them. The top-K requested covers every token the grammar can allow
(``confidence_top_k``), so no share is missed.
"""

from __future__ import annotations

import math

import pyarrow as pa

_ENTRY = [pa.field("token", pa.string()), pa.field("token_id", pa.int32()),
          pa.field("logprob", pa.float32())]
TOP_TYPE = pa.list_(pa.struct(_ENTRY))
LOGPROBS_TYPE = pa.list_(pa.struct([*_ENTRY, pa.field("top", TOP_TYPE)]))

# The most top alternatives confidence asks for: vLLM's engine is built to allow them
# (max_logprobs); a server's own limit is usually OpenAI's 20.
CONFIDENCE_TOP_K_MAX = 100
SERVER_TOP_K_MAX = 20


def confidence_top_k(labels, cap: int = CONFIDENCE_TOP_K_MAX) -> int:
    """Top alternatives enough to see every token the grammar allows at any step: each
    allowed token spells a prefix of some label's rest, one token per prefix length at most,
    plus the end."""
    return min(sum(len(label) for label in labels) + 1, cap)


def truncate_top(entries: list[dict] | None, k: int) -> list[dict] | None:
    """A result's logprobs with each token's alternatives cut to the ``k`` asked for."""
    if entries is None:
        return None
    return [{**e, "top": (e.get("top") or [])[:k]} for e in entries]


def label_masses(labels, entries: list[dict]) -> dict[str, float]:
    """Each label's probability mass read along the generated path (see the module's
    docstring); not normalized. ``entries``: a result's logprobs, with top alternatives."""
    mass = {label: 1.0 for label in labels}
    alive = set(mass)
    prefix = ""
    for entry in entries:
        if not alive:
            break
        seen: dict[str, float] = {}
        for alt in [*(entry.get("top") or []), entry]:
            text, logprob = alt["token"], alt["logprob"]
            if text and logprob is not None and logprob > -math.inf:
                seen.setdefault(text, logprob)  # the same token in top and as chosen
        probs = {text: math.exp(lp) for text, lp in seen.items()}
        growing = sum(p for t, p in probs.items() if any(
            label.startswith(prefix + t) for label in alive))
        for label in alive:
            towards = sum(p for t, p in probs.items() if label.startswith(prefix + t))
            # a complete label keeps what does not grow it into a longer one: the end
            mass[label] *= towards if label != prefix else max(0.0, 1.0 - growing)
        prefix += entry["token"] or ""
        alive = {label for label in alive if label.startswith(prefix)}
    return mass


def label_confidence(labels, text: str | None, entries: list[dict] | None) -> float | None:
    """The chosen label's share of the labels' masses; None when the text is not a label,
    there are no logprobs, or the tokens do not spell the text (a tokenizer whose single
    tokens do not decode to their part of it)."""
    if text is None or entries is None or text not in labels:
        return None
    if "".join(e["token"] or "" for e in entries)[:len(text)] != text:
        return None
    mass = label_masses(labels, entries)
    total = sum(mass.values())
    return mass[text] / total if total > 0 else None


# -- the OpenAI shapes' byte-level fields ---------------------------------------------------
#
# vLLM's ``decoded_token`` is each token decoded alone, so a token that holds part of a UTF-8
# character decodes to U+FFFD: its text is not its bytes, and offsets summed from those texts
# drift from the sample's text (vLLM 0.32's own server computes ``text_offset`` and chat
# ``bytes`` that way, and has the same defect). The bytes a token stands for are in its
# tokenizer's vocabulary; from them, each token's offset in the text is where its first byte
# falls.


def token_bytes_of(model: str | None):
    """``(token_id, token_text) -> bytes`` for a local model's tokenizer.json: a byte-level
    BPE's pieces mapped back to bytes (GPT-2, Llama 3, Qwen, SmolLM), SentencePiece's byte
    fallback pieces (``<0xE2>``) and its ``▁`` as a space. Where the vocabulary cannot say
    (no tokenizer.json, a special token, no id from an OpenAI server), the text's UTF-8."""
    import json
    from pathlib import Path

    def plain(token_id, text):
        return (text or "").encode("utf-8")

    path = Path(model) / "tokenizer.json" if model else None
    if path is None or not path.is_file():
        return plain
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        vocab = spec["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return plain
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], by id
        pieces = {i: entry[0] for i, entry in enumerate(vocab)}
    elif isinstance(vocab, dict):
        pieces = {i: piece for piece, i in vocab.items()}
    else:
        return plain
    special = {t["id"] for t in spec.get("added_tokens") or () if t.get("special")}
    decoders = json.dumps(spec.get("decoder"))
    if '"ByteLevel"' in decoders:
        inverse = {char: byte for byte, char in _byte_level_alphabet().items()}

        def piece_bytes(piece):
            if all(c in inverse for c in piece):
                return bytes(inverse[c] for c in piece)
            return None
    elif '"ByteFallback"' in decoders or '"Metaspace"' in decoders or "\u2581" in decoders:
        def piece_bytes(piece):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    return None
            return piece.replace("\u2581", " ").encode("utf-8")
    else:
        return plain

    def token_bytes(token_id, text):
        piece = pieces.get(token_id) if token_id is not None else None
        if piece is None or token_id in special:
            return plain(token_id, text)
        found = piece_bytes(piece)
        return plain(token_id, text) if found is None else found

    return token_bytes


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are
    written in (``tokenizers``' ByteLevel pre-tokenizer)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def text_offsets(pieces: list[bytes], start: int = 0) -> list[int]:
    """Each token's offset in the text its bytes decode to, in characters: where its first
    byte falls, so a token that continues a character starts where that character does.
    The offsets index the text ``b"".join(pieces).decode("utf-8", "replace")``."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, at = [], start
    for piece in pieces:
        offsets.append(at)
        at += len(decoder.decode(piece))
    return offsets
