"""The result of a code job, as it comes out of the sandbox: hostile JSON, checked and rebuilt.

The executor answers a code job with the JSON that
``readie_executor.jobs.run_job`` wrote, but the job ran in that same process
and may have replaced it with anything. So the bytes are treated like a frame
from a hostile channel (specs/hostile-frames.md): the size is checked before
parsing, the parser refuses what JSON does not define (NaN, Infinity) and what
it leaves ambiguous (duplicate keys), and the result is rebuilt field by field
into frozen dataclasses, so nothing forged rides along.

A valid result is still only the job's own account. Its ``duration_us``,
``phases`` (where the runner's time went; optional) and ``preloaded_modules``
are claims; the worker's clock and the manifest are the truth for timing and
preloads.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from readie_executor.jobs import bounds
from readie_protocol.events import ErrorInfo, Value

__all__ = [
    "INVALID_ERROR_TYPE",
    "clean_text",
    "SandboxAnswer",
    "JobResultInvalid",
    "load_json",
    "max_result_bytes",
    "parse_job_result",
]

# The error type reported when the job's own one does not look like a Python
# class name: it goes into metrics and logs, where free text does not belong.
INVALID_ERROR_TYPE = "InvalidResult"
# Durations and the like are claims of the job, but a number past this is not
# even a plausible claim (a week, in microseconds).
MAX_DURATION_US = 7 * 24 * 3600 * 1_000_000
# An int literal longer than this is refused before Python converts it: no
# field needs more digits, and converting a long literal costs quadratic time.
MAX_INT_DIGITS = 20
_PYTHON_VERSION = re.compile(r"3\.[0-9]{1,3}\.[0-9]{1,3}[a-z0-9+]{0,16}", re.ASCII)
_RESULT_FIELDS = (
    "exit",
    "system_exit",
    "timed_out",
    "stdout",
    "stderr",
    "stdout_truncated",
    "stderr_truncated",
    "error",
    "duration_us",
    "preloaded_modules",
    "python",
    "policy_notes",
    "value",
)
_VALUE_FIELDS = frozenset({"text", "truncated", "data", "omitted"})
# The runner's phases: optional (an executor older than its phase clock sends none).
_RUNNER_PHASES = frozenset(bounds.RUNNER_PHASES)


class JobResultInvalid(Exception):
    """The bytes are not a job result; the message says what is wrong, never echoes them whole."""


@dataclass(frozen=True, slots=True)
class SandboxAnswer:
    """The in-sandbox runner's answer to one job, checked field by field and rebuilt."""

    exit: int
    system_exit: bool  # the code raised SystemExit; in a session that ends the session
    timed_out: bool  # stopped at its deadline from inside: its output is what it wrote so far
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    error: ErrorInfo | None
    duration_us: int
    preloaded_modules: tuple[str, ...]
    python: str
    policy_notes: tuple[str, ...]
    value: Value | None = None  # the last bare expression's, shown
    # The runner's microseconds per phase (readie_executor.jobs.bounds.RUNNER_PHASES): a claim.
    phases: dict[str, int] | None = None


def max_result_bytes(max_output: int) -> int:
    """The size past which a result for a job with this ``max_output`` is refused unread.

    stdout and stderr are each at most ``max_output`` encoded bytes, and every
    other field has its own cap; ``readie_executor.jobs.bounds`` holds the
    numbers both sides agree on. Pass it to the executor client's
    ``MessageReader(max_message_size=...)`` too, so an oversized answer is
    refused before it is buffered at all.
    """
    return bounds.result_budget(max_output)


def parse_job_result(raw: bytes, max_output: int) -> SandboxAnswer:
    """Check and rebuild a job result; raise :class:`JobResultInvalid` for anything else."""
    budget = max_result_bytes(max_output)  # ValueError for a bad max_output: the caller's bug
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"raw must be bytes, got {type(raw).__name__}")
    if len(raw) > budget:
        raise JobResultInvalid(
            f"result is {len(raw)} bytes; at most {budget} are allowed for max_output={max_output}"
        )
    if not raw:
        raise JobResultInvalid("result is empty")
    document = load_json(bytes(raw))
    if not isinstance(document, dict):
        raise JobResultInvalid(f"result must be a JSON object, got {_json_type(document)}")
    return _Fields(document, "").result(max_output)


def load_json(raw: bytes, what: str = "result") -> Any:
    """``raw`` as strict JSON (UTF-8, no NaN, no duplicate keys, bounded integers), which a
    sandbox wrote; :class:`JobResultInvalid` says what is wrong with ``what`` it is."""
    try:
        # Decoded here, strictly: json.loads would guess UTF-16 or UTF-32 from bytes.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JobResultInvalid(f"{what} is not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        return _STRICT.decode(text)
    except JobResultInvalid as exc:
        raise JobResultInvalid(f"{what} {exc}") from None
    except json.JSONDecodeError as exc:
        raise JobResultInvalid(
            f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise JobResultInvalid(f"{what} is nested too deeply") from None
    except ValueError as exc:  # e.g. a float literal Python cannot convert
        raise JobResultInvalid(f"{what} is not valid JSON: {_short(str(exc))}") from None


def _refuse_constant(name: str) -> Any:
    raise JobResultInvalid(f"contains {name}, which JSON does not allow")


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise JobResultInvalid(f"contains an integer of {len(literal)} digits")
    return int(literal)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):  # 1e999: Infinity by another name
        raise JobResultInvalid(f"contains a number out of range: {_short(literal)}")
    return value


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        # Two parsers could pick different values; refuse rather than pick.
        repeated = next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise JobResultInvalid(f"repeats the key {_short(repeated)!r}")
    return document


# One decoder for every result: json.loads(text, **hooks) builds a decoder and its scanner per
# call, ~25-50 us of a step after idle here (decision 33). Shared across threads as json's own
# default decoder is.
_STRICT = json.JSONDecoder(
    parse_constant=_refuse_constant,
    parse_int=_bounded_int,
    parse_float=_finite_float,
    object_pairs_hook=_object_without_duplicates,
)


class _Fields:
    """Typed access to one JSON object; errors name the field by its dotted path."""

    def __init__(self, document: dict[str, Any], prefix: str) -> None:
        self._document = document
        self._prefix = prefix

    def result(self, max_output: int) -> SandboxAnswer:
        for field in _RESULT_FIELDS:
            self._get(field)
        stdout, stdout_cut = self.text("stdout", max_output)
        stderr, stderr_cut = self.text("stderr", max_output)
        return SandboxAnswer(
            exit=self.integer("exit", 0, bounds.MAX_EXIT_STATUS),
            system_exit=self.boolean("system_exit"),
            timed_out=self.boolean("timed_out"),
            stdout=stdout,
            stderr=stderr,
            stdout_truncated=self.boolean("stdout_truncated") or stdout_cut,
            stderr_truncated=self.boolean("stderr_truncated") or stderr_cut,
            error=self.error("error"),
            duration_us=self.integer("duration_us", 0, MAX_DURATION_US),
            preloaded_modules=self.text_list(
                "preloaded_modules",
                bounds.MAX_PRELOADED_MODULES,
                bounds.MAX_MODULE_NAME,
                _is_module_name,
            ),
            python=self.matching("python", _PYTHON_VERSION, bounds.MAX_PYTHON_VERSION),
            policy_notes=self.text_list(
                "policy_notes", bounds.MAX_POLICY_NOTES, bounds.MAX_POLICY_NOTE
            ),
            value=self.value("value", max_output),
            phases=self.phases("phases"),
        )

    def phases(self, field: str) -> dict[str, int] | None:
        value = self._get_optional(field)
        if value is None:
            return None
        # One pass, no per-field helper: this rides on every result (decision 33).
        if (
            not isinstance(value, dict)
            or not value.keys() <= _RUNNER_PHASES
            or not all(type(us) is int and 0 <= us <= MAX_DURATION_US for us in value.values())
        ):
            raise JobResultInvalid(
                f"{self._name(field)} must map the runner's phases to microseconds (0 to {MAX_DURATION_US})"
            )
        return {phase: value[phase] for phase in bounds.RUNNER_PHASES if phase in value}

    def value(self, field: str, max_output: int) -> Value | None:
        value = self._get(field)
        if value is None:
            return None
        if not isinstance(value, dict) or value.keys() != _VALUE_FIELDS:
            raise JobResultInvalid(f"{self._name(field)} must be null or an object of {', '.join(sorted(_VALUE_FIELDS))}")
        fields = _Fields(value, self._name(field) + ".")
        text, cut = fields.text("text", min(max_output, bounds.MAX_VALUE_TEXT))
        data = fields._get("data")
        if not isinstance(data, dict) or not data.keys() <= bounds.DISPLAY_TYPES:
            raise JobResultInvalid(f"{self._name(field)}.data must map display types to text")
        texts = list(data.values())
        if not all(isinstance(item, str) for item in texts) or sum(map(len, texts)) > bounds.MAX_DISPLAY_BYTES:
            raise JobResultInvalid(f"{self._name(field)}.data must hold at most {bounds.MAX_DISPLAY_BYTES} characters")
        omitted = fields.text_list(
            "omitted", len(bounds.DISPLAY_TYPES), bounds.MAX_DISPLAY_TYPE, bounds.DISPLAY_TYPES.__contains__
        )
        return Value(
            text=text,
            truncated=fields.boolean("truncated") or cut,
            data={mime: clean_text(data[mime]) for mime in sorted(data)},
            omitted=omitted,
        )

    def error(self, field: str) -> ErrorInfo | None:
        value = self._get(field)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._wrong(field, "an object or null", value)
        fields = _Fields(value, self._name(field) + ".")
        error_type = fields.error_type("type")
        line = fields._get("line")
        hint = fields._get_optional("hint")
        return ErrorInfo(
            type=error_type,
            message=fields.text("message", bounds.MAX_ERROR_MESSAGE)[0],
            file=None
            if fields._get("file") is None
            else fields.text("file", bounds.MAX_FILE_NAME)[0],
            line=None if line is None else fields.integer("line", 0, bounds.MAX_LINE_NUMBER),
            hint=(
                fields.text("hint", bounds.MAX_HINT)[0]
                if hint is not None and error_type in bounds.HINTED_ERROR_TYPES
                else None
            ),
        )

    def error_type(self, field: str) -> str:
        value = self._get(field)
        if not isinstance(value, str):
            raise self._wrong(field, "a string", value)
        if len(value) > bounds.MAX_ERROR_TYPE or not value.isidentifier():
            return INVALID_ERROR_TYPE
        return value

    def text(self, field: str, limit: int) -> tuple[str, bool]:
        value = self._get(field)
        if not isinstance(value, str):
            raise self._wrong(field, "a string", value)
        cut = len(value) > limit
        return clean_text(value[:limit]), cut

    def matching(self, field: str, pattern: re.Pattern[str], limit: int) -> str:
        text, cut = self.text(field, limit)
        if cut or not pattern.fullmatch(text):
            raise JobResultInvalid(f"{self._name(field)} is not a Python version: {_short(text)!r}")
        return text

    def text_list(
        self,
        field: str,
        max_items: int,
        max_length: int,
        accept: Callable[[str], bool] = lambda _: True,
    ) -> tuple[str, ...]:
        value = self._get(field)
        if not isinstance(value, list):
            raise self._wrong(field, "a list", value)
        if len(value) > max_items:
            raise JobResultInvalid(
                f"{self._name(field)} has {len(value)} entries; at most {max_items} are allowed"
            )
        items = []
        for index, item in enumerate(value):
            if not isinstance(item, str) or len(item) > max_length or not accept(item):
                raise JobResultInvalid(f"{self._name(field)}[{index}] is not an acceptable entry")
            items.append(clean_text(item))
        return tuple(items)

    def integer(self, field: str, low: int, high: int) -> int:
        value = self._get(field)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._wrong(field, "an integer", value)
        if not low <= value <= high:
            raise JobResultInvalid(f"{self._name(field)} must be between {low} and {high}")
        return value

    def boolean(self, field: str) -> bool:
        value = self._get(field)
        if not isinstance(value, bool):
            raise self._wrong(field, "true or false", value)
        return value

    def _get(self, field: str) -> Any:
        if field not in self._document:
            raise JobResultInvalid(f"result lacks {self._name(field)}")
        return self._document[field]

    def _get_optional(self, field: str) -> Any:
        return self._document.get(field)

    def _name(self, field: str) -> str:
        return self._prefix + field

    def _wrong(self, field: str, expected: str, value: Any) -> JobResultInvalid:
        return JobResultInvalid(f"{self._name(field)} must be {expected}, got {_json_type(value)}")


def _is_module_name(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def clean_text(text: str) -> str:
    """``text`` from a sandbox as UTF-8 can carry it: JSON's \\ud800 escapes decode to lone
    surrogates, which no writer downstream (logs, the pool's JSONL, protobuf) can encode."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        int: "an integer",
        float: "a number",
    }.get(type(value), type(value).__name__)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
