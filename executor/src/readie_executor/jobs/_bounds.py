"""Size bounds of a job result, shared by the runner that writes it and the worker that checks it,
and the measure they are counted in (:func:`encoded_size`, :func:`fit_text`).

The runner measures every string by its JSON-encoded UTF-8 size (what crosses
the wire); the worker re-caps by characters, which an honest result always
meets because an encoded string is never shorter than its text.
"""

from __future__ import annotations

import json

# The captured output is held in the sandbox's memory and then in the worker's
# until it is validated; this matches the executor's own capture ceiling.
MAX_OUTPUT_LIMIT = 16 * 1024 * 1024

# Everything in a result except stdout and stderr: the error, the hint, the
# notes, the module list, keys and punctuation. The per-field caps below add up
# to about 42 KiB even when every character needs a JSON escape; the rest is
# margin, so that a new small field does not break old workers.
RESULT_OVERHEAD_BYTES = 64 * 1024

# A message longer than this is a dump, not a message; the traceback on stderr
# carries the detail.
MAX_ERROR_MESSAGE = 4096
# Longer than any real class name, short enough for a metrics label.
MAX_ERROR_TYPE = 100
# A hint lists the grants; a few dozen paths fit.
MAX_HINT = 2048
# PATH_MAX is 4096, but a traceback file name past 1 KiB is noise.
MAX_FILE_NAME = 1024
# Preloads are operator configuration: a handful of packages in practice.
MAX_PRELOADED_MODULES = 256
MAX_MODULE_NAME = 100
# The runner writes a note only when a limit could not be applied as asked.
MAX_POLICY_NOTES = 16
MAX_POLICY_NOTE = 512
# "3.11.2", or a development version like "3.11.0rc1+".
MAX_PYTHON_VERSION = 32
# A line number is a C int in CPython.
MAX_LINE_NUMBER = 2**31 - 1
# An exit status is one byte at the OS level, and the runner reports it that way.
MAX_EXIT_STATUS = 255

# The value of a job's last bare expression (jobs/_value.py): its repr is a
# glance at the object, past 64 KiB a dump (print it instead); display data
# (HTML tables, PNG charts as base64) is a notebook cell's worth: a chart
# is tens of KiB, a 1 MiB HTML table is already more than a model can read.
MAX_VALUE_TEXT = 64 * 1024
MAX_DISPLAY_BYTES = 1024 * 1024
# The display protocol's kinds a value may offer: MIME type and the method that renders it
# (IPython's names), in the order they are offered; the binary ones travel as base64.
DISPLAY_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("text/latex", "_repr_latex_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
)
DISPLAY_TYPES = frozenset(mime for mime, _ in DISPLAY_METHODS)
BINARY_DISPLAY_TYPES = frozenset({"image/png", "image/jpeg"})
# Longer than any MIME type above: what a checker lets an entry of "omitted" be.
MAX_DISPLAY_TYPE = 32

# Where the runner's time went (jobs/_phases.py), in the order they happen: unpickling the
# request and the call's own set-up; the spec; links, files and the seccomp filter; the output
# capture's set-up; the process state the job sees; compiling; the rlimits; the code with its
# deadline and guard; the process state put back; the capture's end and drain; the result's JSON.
RUNNER_PHASES = (
    "request", "spec", "setup", "capture", "state", "compile", "limits", "code", "restore", "drain",
    "encode",
)

# Exception types whose result error carries a hint (what was granted, the limit).
HINTED_ERROR_TYPES = frozenset({"PermissionError", "MemoryError"})


def result_budget(max_output: int) -> int:
    """The most bytes a result for a job with this ``max_output`` may have.

    stdout and stderr are each cut to ``max_output`` encoded bytes, a value's
    text and display data to their own caps, and the other fields fit in
    :data:`RESULT_OVERHEAD_BYTES`.
    """
    if not 0 <= max_output <= MAX_OUTPUT_LIMIT:
        raise ValueError(f"max_output must be between 0 and {MAX_OUTPUT_LIMIT}, got {max_output}")
    return 2 * max_output + MAX_VALUE_TEXT + MAX_DISPLAY_BYTES + RESULT_OVERHEAD_BYTES


# --------------------------------------------------------------------------- the measure

# Strings are measured this many characters at a time: json.dumps does the
# escaping in C, and only the last piece is walked character by character.
_MEASURE_PIECE = 4096


def clean_text(text: str) -> str:
    """``text`` with lone surrogates replaced, so that it encodes as UTF-8."""
    return text.encode("utf-8", "replace").decode("utf-8")


def encoded_size(text: str) -> int:
    """What ``text`` takes in the result: JSON-escaped UTF-8."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8")) - 2


def fit_text(text: str, max_bytes: int) -> tuple[str, bool]:
    """The longest prefix of ``text`` that JSON-encodes to at most ``max_bytes``; was it cut?"""
    text = clean_text(text[: max_bytes + 1])  # every character costs at least one byte
    used = 0
    for start in range(0, len(text), _MEASURE_PIECE):
        piece = text[start : start + _MEASURE_PIECE]
        cost = encoded_size(piece)
        if used + cost <= max_bytes:
            used += cost
            continue
        end = start
        for character in piece:
            cost = encoded_size(character)
            if used + cost > max_bytes:
                break
            used += cost
            end += 1
        return text[:end], True
    return text, False
