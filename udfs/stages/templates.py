"""A prompt template in Jinja's sandbox: compiled once, rendered on one row's values.

Row values go in only as data (a value holding ``{{ ... }}`` stays literal text); a null inside
a struct or list prints as ``on_null`` says (``Null``)."""

from __future__ import annotations

from jinja2 import StrictUndefined, TemplateSyntaxError, meta, nodes
from jinja2.sandbox import SandboxedEnvironment


class TemplateError(ValueError):
    """The prompt template does not parse; ``lineno`` is its line."""

    def __init__(self, message: str, lineno: int | None):
        super().__init__(message)
        self.lineno = lineno


# A template's name for the whole row: row["Product Name"] reaches a column whose name is no
# Jinja name (a space, a dash, a leading digit); row.title is {{ title }}
ROW = "row"


def compile_template(source: str):
    """Compile a template in the sandbox; returns (template, the column names it uses)."""
    env = SandboxedEnvironment(undefined=StrictUndefined, autoescape=False,
                               keep_trailing_newline=True)
    # a null inside a struct or list (``Null``) is none to the template's tests, missing to
    # ``default`` and null in ``tojson``, as a top-level null would be
    env.tests["none"] = lambda value: value is None or isinstance(value, Null)
    env.filters["default"] = env.filters["d"] = _default(env.filters["default"])
    env.policies["json.dumps_kwargs"] = {**env.policies["json.dumps_kwargs"],
                                         "default": _json_null}
    try:
        ast = env.parse(source)
        template = env.from_string(source)
    except TemplateSyntaxError as exc:
        raise TemplateError(exc.message or str(exc), exc.lineno) from None
    variables = meta.find_undeclared_variables(ast)
    if ROW in variables:
        variables = (variables - {ROW}) | _row_columns(ast)
    return template, sorted(variables)


def _row_columns(ast) -> set[str]:
    """The columns a template reaches through ``row``: each use names its column, so that
    pre-flight checks them and a row's nulls are found as for any other column."""
    names, reached = set(), set()
    for node in ast.find_all((nodes.Getitem, nodes.Getattr)):
        if not (isinstance(node.node, nodes.Name) and node.node.name == ROW):
            continue
        if isinstance(node, nodes.Getattr):
            names.add(node.attr)
        elif isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
            names.add(node.arg.value)
        else:
            raise TemplateError('row[...] takes a column\'s name in quotes, e.g. '
                                'row["Product Name"]', node.lineno)
        reached.add(id(node.node))
    for name in ast.find_all(nodes.Name):
        if name.name == ROW and name.ctx == "load" and id(name) not in reached:
            raise TemplateError('row is the whole row: write row["column name"] (a column '
                                'named row is row["row"])', name.lineno)
    return names


def render_template(template, row: dict, on_null: str = "error") -> str:
    """``template`` on one row's values: each column by its name, and all of them as
    ``row``. A null inside a column's struct or list follows ``on_null`` where the template
    prints it (``Null``); the caller has dealt with a column that is null."""
    row = {name: _with_nulls(value, name, on_null) for name, value in row.items()}
    return template.render({**row, ROW: row})


class NullValue(ValueError):
    """A template printed a null inside a column (``on_null: error``): the row's error."""

    def __init__(self, path: str):
        super().__init__(f"{path!r} is null in this row")
        self.path = path


class Null:
    """A null inside a struct or list, as a template sees it. Python's None would print as
    the text "None" ("Color: None", "a, None"); this prints as ``on_null`` says: an error
    naming its place (``meta.color``, ``tags[1]``), or nothing. It is false, equal to none,
    and a field or item of it is null too."""

    __slots__ = ("path", "on_null")

    def __init__(self, path: str, on_null: str):
        self.path, self.on_null = path, on_null

    def __str__(self) -> str:
        if self.on_null == "error":
            raise NullValue(self.path)
        return ""

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other) -> bool:
        return other is None or isinstance(other, Null)

    def __hash__(self) -> int:
        return hash(None)

    def __repr__(self) -> str:  # a whole struct printed: Python's text of it, as before
        return "null"

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return Null(f"{self.path}.{name}", self.on_null)

    def __getitem__(self, key):
        return Null(f"{self.path}[{key!r}]", self.on_null)


def _with_nulls(value, path: str, on_null: str):
    """``value`` with each null inside it a ``Null`` that knows its place."""
    if isinstance(value, dict):
        return {k: Null(f"{path}.{k}", on_null) if v is None
                else _with_nulls(v, f"{path}.{k}", on_null) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # (a map's items are tuples: kept so)
        return type(value)(Null(f"{path}[{i}]", on_null) if v is None
                           else _with_nulls(v, f"{path}[{i}]", on_null)
                           for i, v in enumerate(value))
    return value


def _default(default):
    def with_nulls(value, default_value="", boolean=False):
        return default_value if isinstance(value, Null) else \
            default(value, default_value, boolean)

    return with_nulls


def _json_null(value):
    if isinstance(value, Null):
        return None
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
