"""Job errors: a user's mistake or an environment problem that stops the job (before GPU time
where it can be found then), or a stage that failed while it ran.

Row errors are not exceptions: they are values in a row's ``error`` column (see udfs.columns).
"""

import re
import sys


class JobError(Exception):
    """A problem that stops the whole job. Its message is one line that names the culprit."""


class ConfigError(JobError):
    """The config file or an override is invalid."""


class InputError(JobError):
    """The input table cannot be read or does not fit the job."""


class OutputError(JobError):
    """The output path cannot be written as asked (exists, belongs to another job...)."""


class AlreadyComplete(OutputError):
    """The output is a finished run of this same job and --overwrite was not given: nothing
    to do. The command line says so and exits 0; from Python it is an OutputError."""


class StageError(JobError):
    """A stage of the running job failed (an engine that would not start or died, a part
    that could not be written). The parts already written are kept: a re-run resumes."""


EXIT_JOB_ERROR = 2


def exit_status(command, debug: bool = False) -> int:
    """``command()``'s exit status, a run of it ended as the ``overnight`` command line ends
    it: a user's mistake (a JobError) prints one line, ``overnight: error: ...``, and is
    status 2 (``debug``: raised instead, its traceback shown); Ctrl-C says how to resume and
    is 130. The command line's commands run through it, and the batches of ``overnight
    serve``'s batch workers (serve/worker.py) too."""
    try:
        return command()
    except JobError as exc:
        if debug:
            raise
        from udfs.redact import scrub

        # one line, and no credentials whatever shape a URL holding them took
        print(f"overnight: error: {scrub(one_line(exc, None))}", file=sys.stderr)
        return EXIT_JOB_ERROR
    except KeyboardInterrupt:
        print("\novernight: interrupted; the parts written are kept: run the same command "
              "again to resume", file=sys.stderr)
        return 130


_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception|Exit|Interrupt)): ?(.*)$")


def root_cause(exc: BaseException) -> str:
    """The error underneath Ray's wrappers, in one line: ``ValueError: ...``.

    An error in a Ray actor reaches the driver as text: a traceback, or several chained, in
    the message of a Ray exception. The last ``SomeError: message`` in it that is not Ray's
    own is the cause; the lines indented under it (pydantic lists its fields there) join it."""
    text = "\n".join(str(e) for e in _chain(exc))
    found, lines = None, text.splitlines()
    for i, line in enumerate(lines):
        m = _ERROR_LINE.match(line.strip())
        if m and not line.strip().startswith("ray."):
            detail = [m.group(2)]
            for more in lines[i + 1:]:
                if not more.strip() or more.lstrip().startswith(("File ", "During handling",
                                                                 "The above exception")):
                    break
                if "errors.pydantic.dev" not in more:
                    detail.append(more.strip())
            found = f"{m.group(1)}: {' '.join(d for d in detail if d)}"
    if found is None:
        found = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return found[:400]


def _chain(exc: BaseException):
    """An exception and its causes: Ray's ``cause`` where it has one, else ``__cause__``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        cause = getattr(exc, "cause", None)
        exc = cause if isinstance(cause, BaseException) else exc.__cause__


def one_line(exc: BaseException, limit: int | None = 300, typed: bool = False) -> str:
    """An exception's text as one line (each run of whitespace one space), at most ``limit``
    characters (None: all of it); its type's name where it has no text. ``typed``: its type
    before a text that alone says little (a KeyError's is the key), and without Python's
    advice on an integer's digits (a Batch line's error)."""
    text = " ".join(str(exc).split())
    if typed:
        text = text.split("; use sys.set_int_max_str_digits")[0]
    text = text or type(exc).__name__
    if typed and isinstance(exc, (TypeError, AttributeError, KeyError, IndexError,
                                  RecursionError)):
        text = f"{type(exc).__name__}: {text}"
    return text if limit is None else text[:limit]


def did_you_mean(name: object, choices) -> str:
    """`` (did you mean 'temperature'?)`` where one of ``choices`` is close to ``name`` (a
    misspelt key or column), else ''."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
