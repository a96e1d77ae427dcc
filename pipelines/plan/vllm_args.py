"""What pre-flight reads of vLLM's arguments, from its source and without importing it:
``engine.args`` keys and ``model.reasoning_parser``/``model.tool_parser`` names checked before
any engine starts.
"""

from __future__ import annotations

import functools
from pathlib import Path

from pipelines.errors import ConfigError


def check_engine_args(args: dict) -> None:
    """Each key of ``engine.args`` is one vllm.LLM takes (its own arguments, or
    EngineArgs' fields, where it sends the rest): a misspelt key failed only once an engine
    had started, minutes into a job. Where vLLM is not installed here (a job run on a
    cluster), the engine's own start says."""
    known = vllm_engine_args()
    unknown = [key for key in args if known is not None and key not in known]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"engine.args.{unknown[0]}: not an argument of vllm.LLM or its "
                          f"EngineArgs{hint}")


def check_reasoning_parser(name: str) -> None:
    """model.reasoning_parser names one of vLLM's reasoning parsers (read from its source,
    as the engine's arguments are): a wrong name is one line listing them, before any
    engine starts."""
    _check_parser("model.reasoning_parser", name, vllm_reasoning_parsers(), "reasoning")


def check_tool_parser(name: str) -> None:
    """model.tool_parser names one of vLLM's tool parsers, checked as a reasoning parser is."""
    _check_parser("model.tool_parser", name, vllm_tool_parsers(), "tool")


def _check_parser(key: str, name: str, known: frozenset[str] | None, kind: str) -> None:
    if known is not None and name not in known:
        import difflib

        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{key} {name!r} is not one of vLLM's {kind} parsers; "
                          f"{hint}vLLM has: {', '.join(sorted(known))}")


@functools.cache
def vllm_reasoning_parsers() -> frozenset[str] | None:
    """The names vLLM registers its reasoning parsers under (``vllm/reasoning/__init__.py``,
    ``_REASONING_PARSERS_TO_REGISTER``), read from its source, not imported; None where vLLM
    is not installed here or its source is laid out otherwise."""
    return _registered_names("reasoning/__init__.py", "_REASONING_PARSERS_TO_REGISTER")


@functools.cache
def vllm_tool_parsers() -> frozenset[str] | None:
    """The names vLLM registers its tool parsers under (``vllm/tool_parsers/__init__.py``,
    ``_TOOL_PARSERS_TO_REGISTER``), read from its source, not imported; None where vLLM is
    not installed here or its source is laid out otherwise."""
    return _registered_names("tool_parsers/__init__.py", "_TOOL_PARSERS_TO_REGISTER")


def _registered_names(path: str, variable: str) -> frozenset[str] | None:
    """The string keys of the dict literal assigned to ``variable`` in vLLM's ``path``."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
        root = Path(next(iter(spec.submodule_search_locations)))
        tree = ast.parse((root / path).read_text())
    except (AttributeError, StopIteration, TypeError, OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(n, ast.Name) and n.id == variable
               for n in targets) and isinstance(node.value, ast.Dict):
            names = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            return frozenset(names) or None
    return None


@functools.cache
def vllm_engine_args() -> frozenset[str] | None:
    """The keyword arguments vllm.LLM accepts, read from vLLM's source, not imported
    (``import vllm`` takes seconds and torch with it); None where vLLM is not installed or its
    source is not laid out as expected."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
        root = Path(next(iter(spec.submodule_search_locations)))
        trees = {name: ast.parse((root / path).read_text())
                 for name, path in (("LLM", "entrypoints/llm.py"),
                                    ("EngineArgs", "engine/arg_utils.py"))}
    except (AttributeError, StopIteration, TypeError, OSError, SyntaxError, ValueError):
        return None
    names = set()
    for cls, tree in trees.items():
        body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef)
                     and n.name == cls), None)
        if body is None:
            return None
        for node in body:
            if cls == "EngineArgs" and isinstance(node, ast.AnnAssign) \
                    and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif cls == "LLM" and isinstance(node, ast.FunctionDef) and node.name == "__init__":
                names.update(a.arg for a in node.args.args[1:] + node.args.kwonlyargs)
    return frozenset(names) if names else None
