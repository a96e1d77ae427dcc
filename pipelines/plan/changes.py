"""What changed between two of a job's settings (the resume fingerprint, a request key's
parts), in the words a refusal or the reuse line says: the settings by name, the model's files
and an adapter's by the files that differ (pipelines/plan/model_files.py)."""

from __future__ import annotations

from pipelines.plan.model_files import adapters_changed, files_changed


def diff_fingerprints(old: dict, new: dict) -> list[str]:
    """The top-level keys whose values differ, e.g. ['sampling', 'input files']. A record
    written before the fingerprint held the model's files (no ``model.files``) matches on
    them: its run is resumed, not refused."""
    old, new = _files_apart(old, new)
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _files_apart(old: dict, new: dict) -> tuple[dict, dict]:
    """Both fingerprints, without ``model.files`` where the old one has none."""
    model, ours = old.get("model"), new.get("model")
    if isinstance(model, dict) and "files" not in model and isinstance(ours, dict):
        new = {**new, "model": {k: v for k, v in ours.items() if k != "files"}}
    return old, new


def what_changed(old: dict, new: dict) -> str:
    """``diff_fingerprints`` in words, for a refusal: ``sampling, engine changed``; the model's
    files and adapters by the files that differ (``model files changed: model.safetensors
    (modification time)``); a step by its index, name and settings."""
    changed = diff_fingerprints(old, new)
    old, new = _files_apart(old, new)
    plain, said = [], []
    for key in changed:
        a, b = old.get(key), new.get(key)
        if key == "model" and isinstance(a, dict) and isinstance(b, dict) \
                and a.get("files") != b.get("files"):
            said.append(f"model files changed: {files_changed(a.get('files'), b.get('files'))}")
            if _without(a, "files") != _without(b, "files"):
                plain.append("model")
        elif key == "adapters":
            said.append(f"adapters changed: {adapters_changed(a, b)}")
        elif key == "steps" and isinstance(a, list) and isinstance(b, list) \
                and len(a) == len(b) and all(isinstance(s, dict) for s in a + b):
            said += [f"steps[{i}] ({y.get('name')}) changed: {', '.join(changed_keys(x, y))}"
                     for i, (x, y) in enumerate(zip(a, b)) if x != y]
        else:
            plain.append(key)
    return "; ".join(([f"{', '.join(plain)} changed"] if plain else []) + said)


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The settings that differ, as dotted keys (``prompt.template``), at most two deep."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict) and not prefix:
            out += changed_keys(a, b, f"{name}.")
        else:
            out.append(name)
    return out or ["the settings"]


def changed_settings(old: dict, new: dict) -> str:
    """``changed_keys`` in words (``prompt.template changed``), the model's files and the
    adapters by the files that differ (``model files changed: chat_template.jinja
    (content)``)."""
    keys = changed_keys(old, new)
    files = "model.files" in keys
    adapters = any(k == "adapters" or k.startswith("adapters.") for k in keys)
    plain = [k for k in keys if k != "model.files" and k != "adapters"
             and not k.startswith("adapters.")]
    said = [f"{', '.join(plain)} changed"] if plain else []
    if files:
        said.append("model files changed: " + files_changed(
            (old.get("model") or {}).get("files"), (new.get("model") or {}).get("files")))
    if adapters:
        said.append("adapters changed: " + adapters_changed(old.get("adapters"),
                                                           new.get("adapters")))
    return "; ".join(said)


def _without(record: dict, key: str) -> dict:
    return {k: v for k, v in record.items() if k != key}
