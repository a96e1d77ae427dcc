"""A chat template's content format, and a message's content in it, as vLLM's chat path has them.

Chat templates read a message's content one of two ways: as a list of parts (``{"type":
"image"}``, ``{"type": "text", "text": ...}``: "openai"), or as one string ("string": ``{{
message['content'] }}`` added to other strings). vLLM's chat path (``LLM.chat``) tells which
from the template's syntax tree and hands a string-format template each message's text with
each image's placeholder in it (``vllm/renderers/hf.py: _detect_content_format``,
``vllm/renderers/chat_utils.py: _parse_chat_message_content_parts``). A vision model whose
template takes string content was handed a list: ``TypeError: can only concatenate str (not
"list") to str`` stopped the whole job. The renderer (udfs/stages/prompts.py) now does as vLLM does:

- ``detect_content_format``: vLLM's detection, ported to run without importing vLLM (seconds
  and torch, on the driver: ``overnight validate``, pre-flight); tests/test_images.py checks
  it against vLLM's own on the templates it meets;
- ``string_content``: a message's parts as one string, vLLM's way: the text parts joined by a
  newline, each image's placeholder before them (a placeholder the text already holds stands
  where it is), more placeholders in the text than images refused;
- ``image_placeholder``: the placeholder text vLLM's model class gives an image
  (``get_placeholder_str``), from vLLM itself where it is installed.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter, deque
from pathlib import Path

@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """"openai" where the template loops over a message's content, else "string"; "string"
    where it does not parse (vLLM's default then too)."""
    try:
        # (parsed as vLLM parses it: in transformers' environment, with its extensions' tags)
        ast = _transformers_env().parse(template)
    except Exception:  # noqa: BLE001 - a template jinja cannot parse: vLLM's default
        return "string"
    try:
        next(_content_loops(ast))
    except StopIteration:
        return "string"
    except Exception:  # noqa: BLE001 - as vLLM: a tree it cannot walk takes the default
        return "string"
    return "openai"


def resolve_content_format(template: str | None, given: str = "auto") -> str:
    """The format a job renders in: ``given`` (prompt.chat_template_content_format), unless
    "auto": then the template's own (vLLM's ``resolve_chat_template_content_format``)."""
    if given != "auto":
        return given
    return detect_content_format(template) if template else "string"


def _generation_extension():
    """transformers' ``{% generation %}`` tag (its AssistantTracker), which renders its body
    as it is (the tracking of assistant tokens is no business of ours)."""
    import jinja2.ext
    from jinja2 import nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_noop"), [], [], body).set_lineno(lineno)

        def _noop(self, caller):
            return caller()

    return Generation


def _is_var(node, name: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node, name: str, key: str) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, nodes.Const) \
            and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node, name: str, key: str | None = None) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _assigned_from(root, name: str):
    """``name`` and every variable assigned from it (or its elements), transitively."""
    from jinja2 import nodes

    yield name
    todo = deque([name])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(nodes.Assign):
            if _is_var_or_elems(assign.node, current) and isinstance(assign.target, nodes.Name):
                yield assign.target.name
                if assign.target.name != current:
                    todo.append(assign.target.name)


def _message_names(root):
    """The loop variables of ``{% for message in messages %}`` loops."""
    from jinja2 import nodes

    sources = list(_assigned_from(root, "messages"))
    for loop in root.find_all(nodes.For):
        if any(_is_var_or_elems(loop.iter, name) for name in sources) \
                and isinstance(loop.target, nodes.Name):
            yield loop.target.name


def _content_loops(root):
    """Loops over a message's content: ``{% for part in message['content'] %}``, over a
    macro's parameter given a message's content, or over a variable named ``content``."""
    from jinja2 import nodes

    messages = list(_message_names(root))
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        params = {arg.name for arg in macro.args}
        given: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, m, "content")
                                               for m in messages):
                    given.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if isinstance(kwarg, nodes.Keyword) and kwarg.key in params and any(
                        _is_var_or_elems(kwarg.value, m, "content") for m in messages):
                    given.add(kwarg.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if given:
                by_loop[id(loop)] = given
    for loop in root.find_all(nodes.For):
        if not isinstance(loop.target, nodes.Name):
            continue
        if any(_is_var_or_elems(loop.iter, m, "content") for m in messages):
            yield loop
        elif isinstance(loop.iter, nodes.Name) and (
                loop.iter.name in by_loop.get(id(loop), ())
                or (id(loop) not in in_macros and loop.iter.name == "content")):
            yield loop


class ContentError(ValueError):
    """A message cannot be put in the template's format (more placeholders than images)."""


def string_content(parts: list[dict], placeholder, taken: int = 0) -> str:
    """A message's parts (``{"type": "text"|"image"}``) as one string, vLLM's way: the texts
    joined by a newline, each image's placeholder (``placeholder(n)``: the conversation's
    n-th image's, ``taken`` of them in earlier messages) before them unless the text holds
    it already."""
    texts = [p["text"] for p in parts if p.get("type") == "text"]
    shown = [placeholder(taken + i + 1) for i in range(sum(p.get("type") == "image"
                                                         for p in parts))]
    text = "\n".join(texts)
    missing = []
    for mark, count in Counter(shown).items():
        count -= text.count(mark)
        if count < 0:
            raise ContentError(f"the text holds more {mark!r} placeholders than the "
                               "message has images")
        missing += [mark] * count
    return "\n".join([*missing, text] if text else missing)


@functools.lru_cache(maxsize=8)
def image_placeholder(model: str, trust_remote_code: bool = False):
    """``n -> the text standing for the n-th image`` of a model's prompt, as vLLM's model class
    gives it (``get_placeholder_str``); without vLLM here (a job whose engine is a server), the
    processor's image token."""
    architectures = _config(model).get("architectures") or []
    try:
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:
        ModelRegistry = None  # noqa: N806
    for name in architectures if ModelRegistry is not None else ():
        try:
            cls = ModelRegistry._try_load_model_cls(name)  # noqa: SLF001 - its own lookup
        except Exception:  # noqa: BLE001 - an architecture vLLM has no class for
            cls = None
        if cls is not None and hasattr(cls, "get_placeholder_str"):
            return functools.partial(_vllm_placeholder, cls)
    token = (json_object(Path(model) / "processor_config.json").get("image_token")
             or json_object(Path(model) / "tokenizer_config.json").get("image_token") or "<image>")
    return lambda n: token


def _vllm_placeholder(cls, n: int) -> str:
    found = cls.get_placeholder_str("image", n)
    if not found:
        raise ContentError(f"vLLM's {cls.__name__} gives images no placeholder in a text")
    return found


def _config(model: str) -> dict:
    return json_object(Path(model) / "config.json")


def json_object(path: Path) -> dict:
    """A JSON file's object; {} where it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # what transformers hands a chat template (special_tokens_map)


class TemplateOnly:
    """A local model's chat template without its tokenizer: pre-flight renders a few rows
    through it on the driver, where importing transformers takes seconds and its tokenizer
    torch. Rendered in the Jinja environment transformers' ``apply_chat_template`` renders in
    (``chat_template_utils._compile_jinja_template``: its options, filters and globals), the
    template found where transformers finds it (chat_template.jinja before
    tokenizer_config.json's), with the special tokens it hands a template (``special_tokens``).
    ``chat_template`` is None where there is none to find here. ``missing_names``: the names
    a render found undefined (a tokenizer class's default special token, say, which only
    transformers knows): pre-flight refuses no job for those (udfs/stages/prompts.py:
    rows_fail_alike)."""

    def __init__(self, model: str):
        folder = Path(model)
        settings = json_object(folder / "tokenizer_config.json")
        self.chat_template = _template_in(folder, settings)
        self.special = special_tokens(folder, settings)
        self.missing_names: set[str] = set()
        self._compiled = None

    def get_chat_template(self) -> str | None:
        return self.chat_template

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True, tools: list | None = None,
                            **kwargs) -> str:
        import jinja2

        if self._compiled is None:
            self._compiled = _transformers_env().from_string(self.chat_template)
        try:
            return self._compiled.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special, **kwargs})
        except jinja2.exceptions.UndefinedError as exc:
            # jinja's words for a name not defined at all ("'bos_token' is undefined"; a
            # missing attribute or key is "... has no attribute ...": the row's)
            name = re.fullmatch(r"'(\w+)' is undefined", str(exc))
            if name:
                self.missing_names.add(name.group(1))
            raise


def special_tokens(folder: Path, settings: dict) -> dict[str, str]:
    """The named special tokens transformers hands a chat template (``special_tokens_map``):
    tokenizer_config.json's, and special_tokens_map.json's (a value a string or {"content":
    ...}), which transformers reads over them where the config has no
    ``added_tokens_decoder`` (an older layout; with one, 5.x reads the config's alone, and
    the map here only names what the config does not)."""
    found: dict[str, str] = {}
    older = json_object(folder / "special_tokens_map.json")
    sources = ([older, settings] if "added_tokens_decoder" in settings
               else [settings, older])  # (the later source wins)
    for source in sources:
        for name in SPECIAL_TOKENS:
            value = source.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                found[name] = value
    return found


def _transformers_env():
    """transformers' chat template environment: trimmed blocks, loop controls, the
    ``generation`` tag, ``tojson`` without HTML escapes, ``raise_exception``,
    ``strftime_now``."""
    from datetime import datetime

    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[
        _generation_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _template_in(folder: Path, settings: dict) -> str | None:
    """The default chat template of a model folder, as transformers looks for it."""
    try:
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    except OSError:
        pass
    found = settings.get("chat_template") or json_object(folder / "chat_template.json").get(
        "chat_template")  # (the last: a processor's, in an older layout)
    if isinstance(found, list):  # named templates: the default one
        found = next((t.get("template") for t in found if isinstance(t, dict)
                      and t.get("name") == "default"), None)
    return found if isinstance(found, str) and found else None
