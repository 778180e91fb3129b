"""The host-function wire format, without I/O: limits, frames, and a lossless JSON codec.

While a code job runs, the sandbox may send *call frames* on the executor's
connection and the worker answers each with one *reply frame*; the job's
final answer follows as before (decision 8). Both are framing-v2 messages
holding compact UTF-8 JSON::

    {"call":{"call_id":1,"function":"search","args":["readie"],"kwargs":{"limit":2}}}
    {"reply":{"call_id":1,"result":["first hit","second hit"]}}
    {"reply":{"call_id":1,"error":"backend unavailable"}}

The sandbox (:mod:`readie_executor.jobs._host`) and the worker
(``readie_worker._host_frames``) share this module: the limits, the frame
prefixes, and the codec. :func:`loads` and :func:`dumps` keep no Python
recursion (an explicit stack), so a value nested as deeply as its byte budget
allows crosses intact where ``json`` would raise RecursionError; integers keep
every digit; NaN and the infinities, which JSON does not define, are refused;
so are duplicate keys, which two parsers could resolve differently.

Standard library only: this runs in the sandbox's own python3.
"""

from __future__ import annotations

import json
import keyword
import math
import re
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import Any

__all__ = [
    "CALL_PREFIX",
    "FRAME_OVERHEAD_BYTES",
    "MAX_ARGUMENT_BYTES",
    "MAX_CALLS_PER_TASK",
    "MAX_CALL_FRAME_BYTES",
    "MAX_CALL_ID",
    "MAX_FUNCTIONS",
    "MAX_FUNCTION_NAME",
    "MAX_INT_DIGITS",
    "MAX_OUTPUT_CHUNK_BYTES",
    "MAX_OUTPUT_FRAME_BYTES",
    "MAX_RESULT_BYTES",
    "OUTPUT_INTERVAL_S",
    "OUTPUT_PREFIX",
    "OUTPUT_STREAMS",
    "REPLY_PREFIX",
    "RESERVED_NAMES",
    "WireError",
    "dumps",
    "encode_call",
    "encode_output",
    "function_name_problem",
    "loads",
]

# The pool spec: "Arguments and results are JSON, at most 1 MB each way"; the
# pool's own reply check (readie_router MAX_REPLY_BYTES) uses the same number.
MAX_ARGUMENT_BYTES = 1_000_000
MAX_RESULT_BYTES = 1_000_000
# A call frame is the arguments plus the envelope around them: the keys, the
# call id, the function's name (at most MAX_FUNCTION_NAME bytes, ASCII) and
# punctuation, well under 1 KiB; the rest is margin.
FRAME_OVERHEAD_BYTES = 4096
MAX_CALL_FRAME_BYTES = MAX_ARGUMENT_BYTES + FRAME_OVERHEAD_BYTES
# The pool spec: "Each task may make 1,000 calls".
MAX_CALLS_PER_TASK = 1000
# Call ids count a task's calls from 1; anything past the largest integer a
# double holds exactly is not an id any client could echo back.
MAX_CALL_ID = 2**53 - 1
# Declared names per task, as the pool protocol allows (readie_router MAX_FUNCTIONS).
MAX_FUNCTIONS = 256
# Longer than any tool name a model is shown; the frame overhead counts on it.
MAX_FUNCTION_NAME = 255
# Python's own default bound on int/str conversion (sys.int_max_str_digits),
# which exists because the conversion costs quadratic time; a literal with more
# digits is refused before anything converts it.
MAX_INT_DIGITS = 4300
# Module attributes that are not host functions: the error class, and dunders
# (a function named __getattr__ would become the module's attribute hook).
RESERVED_NAMES = frozenset({"HostError"})

# Frames are told apart from the job's final answer by their first bytes; the
# sandbox and the worker always write these exact compact prefixes.
CALL_PREFIX = b'{"call":'
REPLY_PREFIX = b'{"reply":'
OUTPUT_PREFIX = b'{"output":'

# Output frames (a job that asked for streamed output; decision 16) carry what
# the job wrote, sandbox to worker, no reply:
#     {"output":{"stream":"stdout","data":"step 1\n"}}
OUTPUT_STREAMS = ("stdout", "stderr")
# The sandbox sends what one stream gathered at most this often: a person
# watching sees output within a blink, and a job printing in a tight loop
# costs one frame per window, not one per print.
OUTPUT_INTERVAL_S = 0.05
# ...or sooner once this much is gathered: one read of a full pipe (64 KiB).
MAX_OUTPUT_CHUNK_BYTES = 64 * 1024
# The data is text: every byte may take a 6-byte escape (a control character
# as \u00XX), and an invalid byte becomes U+FFFD, 3 bytes; the rest is the envelope.
MAX_OUTPUT_FRAME_BYTES = 6 * MAX_OUTPUT_CHUNK_BYTES + FRAME_OVERHEAD_BYTES


class WireError(ValueError):
    """Bytes that are not JSON as this wire accepts it, or a value that cannot be sent as JSON."""


def function_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a host function's name, or None if it can."""
    if not isinstance(name, str):
        return f"a function name must be a string, got {type(name).__name__}"
    # ASCII only, like the pool: lookalike names would read the same in a tool
    # description and differ in the sandbox.
    if not (name.isascii() and name.isidentifier()) or keyword.iskeyword(name):
        return f"{name[:MAX_FUNCTION_NAME]!r} is not a Python identifier"
    if len(name) > MAX_FUNCTION_NAME:
        return f"a function name may have at most {MAX_FUNCTION_NAME} characters"
    if name in RESERVED_NAMES or (name.startswith("__") and name.endswith("__")):
        return f"{name!r} is reserved in readie_host"
    return None


# --------------------------------------------------------------------------- encoding


def encode_call(call_id: int, function: str, args: Any, kwargs: Any) -> bytes:
    """A call frame; WireError, TypeError or ValueError for arguments that cannot be sent."""
    encoded_args = dumps(list(args), MAX_ARGUMENT_BYTES, what="arguments")
    encoded_kwargs = dumps(kwargs, MAX_ARGUMENT_BYTES - len(encoded_args), what="arguments")
    return b"".join(
        (
            CALL_PREFIX,
            b'{"call_id":%d,"function":' % call_id,
            dumps(function),
            b',"args":',
            encoded_args,
            b',"kwargs":',
            encoded_kwargs,
            b"}}",
        )
    )


def encode_output(stream: str, data: str) -> bytes:
    """An output frame: ``data`` the job wrote on ``stream`` (one of OUTPUT_STREAMS)."""
    return b"".join((OUTPUT_PREFIX, b'{"stream":', dumps(stream), b',"data":', dumps(data), b"}}"))


class _Close:
    """Markup pushed on the encoder's stack: text to write, and the container it closes."""

    __slots__ = ("text", "closes")

    def __init__(self, text: str, closes: int | None = None) -> None:
        self.text = text
        self.closes = closes


_COMMA = _Close(",")
# An integer with more bits than this has more than MAX_INT_DIGITS decimal digits.
_MAX_INT_BITS = math.ceil(MAX_INT_DIGITS * math.log2(10))


def dumps(value: Any, limit: int | None = None, what: str = "value") -> bytes:
    """``value`` as compact UTF-8 JSON, at most ``limit`` bytes.

    Accepts None, bool, int, float, str, list, tuple and dict with str keys
    (subclasses by their base type's value, as ``json`` does). Raises
    TypeError for anything else and for non-str keys (``json`` would turn
    ``1`` into ``"1"``, which is not lossless), ValueError for NaN, the
    infinities, a circular reference, an integer of more than
    :data:`MAX_INT_DIGITS` digits, or more than ``limit`` bytes (checked
    as the output grows, so a huge value is refused early).
    """
    out: list[str] = []
    size = 0  # characters so far: a lower bound of the UTF-8 size
    on_path: set[int] = set()
    pending: list[Any] = [value]
    while pending:
        item = pending.pop()
        if type(item) is _Close:
            out.append(item.text)
            size += 1
            if item.closes is not None:
                on_path.discard(item.closes)
            continue
        if item is None:
            text = "null"
        elif item is True:
            text = "true"
        elif item is False:
            text = "false"
        elif isinstance(item, str):
            text = _string(item)
        elif isinstance(item, int):
            text = _integer(item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(
                    f"{float.__repr__(item)} is not JSON: only finite numbers can be sent"
                )
            text = float.__repr__(item)
        elif isinstance(item, (list, tuple)):
            _enter(item, on_path)
            if not item:
                text = "[]"
                on_path.discard(id(item))
            else:
                text = "["
                pending.append(_Close("]", id(item)))
                for index in range(len(item) - 1, 0, -1):
                    pending.append(item[index])
                    pending.append(_COMMA)
                pending.append(item[0])
        elif isinstance(item, dict):
            _enter(item, on_path)
            if not item:
                text = "{}"
                on_path.discard(id(item))
            else:
                text = "{"
                pending.append(_Close("}", id(item)))
                entries = list(item.items())
                for index in range(len(entries) - 1, -1, -1):
                    key, entry = entries[index]
                    if not isinstance(key, str):
                        raise TypeError(
                            f"keys must be str to be sent as JSON, got {type(key).__name__}"
                        )
                    pending.append(entry)
                    pending.append(_Close(_string(key) + ":"))
                    if index:
                        pending.append(_COMMA)
        else:
            raise TypeError(
                f"{type(item).__name__} is not JSON: send None, bool, int, float, str, "
                "list, tuple or dict (with str keys)"
            )
        out.append(text)
        size += len(text)
        if limit is not None and size > limit:
            raise ValueError(f"{what} too large: more than {limit} bytes of JSON")
    encoded = "".join(out).encode("utf-8")
    if limit is not None and len(encoded) > limit:
        raise ValueError(f"{what} too large: more than {limit} bytes of JSON")
    return encoded


def _enter(container: object, on_path: set[int]) -> None:
    key = id(container)
    if key in on_path:
        raise ValueError("circular reference: a container holds itself")
    on_path.add(key)


def _string(text: str) -> str:
    if text.isascii():
        return encode_basestring(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escaped, so it survives as \udXXX
        return encode_basestring_ascii(text)
    return encode_basestring(text)


def _integer(value: int) -> str:
    if value.bit_length() > _MAX_INT_BITS:
        raise ValueError(f"an integer of more than {MAX_INT_DIGITS} digits cannot be sent")
    try:
        text = int.__repr__(value)  # an int subclass (IntEnum) by its value, as json does
    except ValueError:  # past sys.int_max_str_digits
        text = ""
    if not text or len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of more than {MAX_INT_DIGITS} digits cannot be sent")
    return text


# --------------------------------------------------------------------------- decoding

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_SIMPLE_STRING = re.compile(r'([^"\\\x00-\x1f]*)"')
_STRING_CHUNK = re.compile(r'([^"\\\x00-\x1f]*)(["\\\x00-\x1f])')
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": ("true", True), "f": ("false", False), "n": ("null", None)}


def loads(data: bytes | str) -> Any:
    """Parse one JSON document strictly; raise :class:`WireError` for anything else.

    Bytes must be UTF-8 (no BOM). Agrees with ``json.loads`` on every document
    ``json.dumps`` writes, except that it has no depth limit and refuses NaN,
    Infinity, -Infinity, numbers out of a double's range, integers of more than
    :data:`MAX_INT_DIGITS` digits and duplicate keys. Lone surrogates escaped as
    ``\\udXXX`` stay in strings, as with ``json.loads``.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WireError(f"not UTF-8: {exc.reason} at byte {exc.start}") from None
    elif isinstance(data, str):
        text = data
    else:
        raise TypeError(f"loads() takes bytes or str, got {type(data).__name__}")
    try:
        return _STRICT_JSON.decode(text)
    except (ValueError, RecursionError):
        # Nested deeper than json recurses, or refused: the iterative parser
        # decides, and names the fault the same way whichever parser met it.
        return _Parser(text).document()


# The fast path of loads: the standard library's C scanner, its hooks refusing
# what this wire refuses, so what it accepts _Parser accepts, with the same value.
# Every frame and reply crosses a parser on each hop; this one is several times faster.


def _refuse(why: str) -> Any:
    raise WireError(why)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    entries = dict(pairs)
    return entries if len(entries) == len(pairs) else _refuse("duplicate key")


_STRICT_JSON = json.JSONDecoder(
    object_pairs_hook=_unique_keys,
    parse_constant=lambda name: _refuse(f"{name} is not JSON"),
    parse_float=lambda text: _refuse("out of range") if math.isinf(value := float(text)) else value,
    parse_int=lambda text: int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _refuse("too many digits"),
)


class _OpenObject:
    """An object being parsed: its entries so far and the key whose value comes next."""

    __slots__ = ("entries", "key")

    def __init__(self, key: str) -> None:
        self.entries: dict[str, Any] = {}
        self.key = key


class _Parser:
    """One document. The stack holds the open containers: lists and :class:`_OpenObject`."""

    def __init__(self, text: str) -> None:
        self.text = text

    def fail(self, what: str, pos: int) -> WireError:
        return WireError(f"{what} at character {pos}")

    def document(self) -> Any:
        text = self.text
        end = len(text)
        ws = _WHITESPACE.match
        stack: list[Any] = []
        pos = ws(text, 0).end()
        while True:
            # A value starts at pos (whitespace already skipped).
            char = text[pos : pos + 1]
            if char == "[":
                pos = ws(text, pos + 1).end()
                if text[pos : pos + 1] == "]":
                    value: Any = []
                    pos += 1
                else:
                    stack.append([])
                    continue
            elif char == "{":
                pos = ws(text, pos + 1).end()
                if text[pos : pos + 1] == "}":
                    value = {}
                    pos += 1
                else:
                    key, pos = self.key(pos)
                    stack.append(_OpenObject(key))
                    continue
            elif char == '"':
                value, pos = self.string(pos + 1)
            elif char in _LITERALS:
                word, value = _LITERALS[char]
                if text.startswith(word, pos):
                    pos += len(word)
                else:
                    raise self.fail("unexpected characters", pos)
            else:
                match = _NUMBER.match(text, pos)
                if match is None:
                    if text.startswith("NaN", pos) or text.startswith("Infinity", pos) or (
                        text.startswith("-Infinity", pos)
                    ):
                        raise self.fail("NaN and Infinity are not JSON", pos)
                    if pos >= end:
                        raise self.fail("unexpected end of data: a value was expected", pos)
                    raise self.fail(f"unexpected character {char!r}", pos)
                value = self.number(match)
                pos = match.end()
            # A value is complete: put it in its container, closing what it completes.
            while True:
                pos = ws(text, pos).end()
                if not stack:
                    if pos != end:
                        raise self.fail("extra data after the document", pos)
                    return value
                top = stack[-1]
                char = text[pos : pos + 1]
                if type(top) is list:
                    top.append(value)
                    if char == ",":
                        pos = ws(text, pos + 1).end()
                        break
                    if char == "]":
                        value = stack.pop()
                        pos += 1
                        continue
                    raise self.fail("expected ',' or ']'", pos)
                entries, key = top.entries, top.key
                if key in entries:
                    raise self.fail(f"duplicate key {key[:80]!r}", pos)
                entries[key] = value
                if char == ",":
                    top.key, pos = self.key(ws(text, pos + 1).end())
                    break
                if char == "}":
                    stack.pop()
                    value = entries
                    pos += 1
                    continue
                raise self.fail("expected ',' or '}'", pos)

    def key(self, pos: int) -> tuple[str, int]:
        """A key and its colon; returns the position of the value after them."""
        text = self.text
        if text[pos : pos + 1] != '"':
            raise self.fail("expected a string key", pos)
        key, pos = self.string(pos + 1)
        pos = _WHITESPACE.match(text, pos).end()
        if text[pos : pos + 1] != ":":
            raise self.fail("expected ':'", pos)
        return key, _WHITESPACE.match(text, pos + 1).end()

    def string(self, pos: int) -> tuple[str, int]:
        """The string whose opening quote is just before ``pos``, and the position after it."""
        text = self.text
        simple = _SIMPLE_STRING.match(text, pos)
        if simple is not None:
            return simple.group(1), simple.end()
        chunks: list[str] = []
        while True:
            match = _STRING_CHUNK.match(text, pos)
            if match is None:
                raise self.fail("unterminated string", pos)
            content, terminator = match.groups()
            if content:
                chunks.append(content)
            pos = match.end()
            if terminator == '"':
                return "".join(chunks), pos
            if terminator != "\\":
                raise self.fail("control character in a string", pos - 1)
            escape = text[pos : pos + 1]
            if escape != "u":
                if escape not in _ESCAPES:
                    raise self.fail("invalid escape", pos - 1)
                chunks.append(_ESCAPES[escape])
                pos += 1
                continue
            code = self.hex4(pos + 1)
            pos += 5
            # A high surrogate followed by an escaped low one is one character, as in json.
            if 0xD800 <= code <= 0xDBFF and text.startswith("\\u", pos):
                low = self.hex4(pos + 2)
                if 0xDC00 <= low <= 0xDFFF:
                    code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                    pos += 6
            chunks.append(chr(code))

    def hex4(self, pos: int) -> int:
        match = _HEX4.match(self.text, pos)
        if match is None:
            raise self.fail("invalid \\uXXXX escape", pos - 2)
        return int(match.group(), 16)

    def number(self, match: re.Match[str]) -> int | float:
        literal = match.group()
        fraction, exponent = match.group(1, 2)
        if fraction is None and exponent is None:
            if len(literal) - (literal[0] == "-") > MAX_INT_DIGITS:
                raise self.fail(f"an integer of more than {MAX_INT_DIGITS} digits", match.start())
            return int(literal)
        value = float(literal)
        if math.isinf(value):
            raise self.fail("a number out of range", match.start())
        return value
