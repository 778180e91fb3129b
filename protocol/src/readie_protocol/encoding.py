"""A client's request lines: :func:`encode_request` checks what the pool would refuse before it is sent."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .errors import RequestError
from .lines import MAX_LINE_BYTES

__all__ = ["encode_request"]


def encode_request(request: Mapping[str, Any]) -> bytes:
    """``request`` as one UTF-8 JSON line with its newline; :class:`RequestError` if the pool would refuse its size.

    Checked before sending, so the caller learns the limit from an exception
    naming the field instead of from a refusal after the upload.
    """
    try:
        data = _dumps(request).encode("utf-8")
    except UnicodeEncodeError:
        field = next((key for key, value in request.items() if not _encodable(value)), None)
        raise RequestError("contains a lone surrogate (\\ud800-\\udfff), which UTF-8 cannot carry", field) from None
    except (TypeError, ValueError) as exc:
        raise TypeError(f"request is not JSON: {exc}") from None
    if len(data) > MAX_LINE_BYTES:
        sizes = {key: len(_dumps(value).encode("utf-8")) for key, value in request.items()}
        biggest = max(sizes, key=sizes.__getitem__)
        hint = " (pass long code as a file with script=...)" if biggest == "code" else ""
        instead = "upload large files into a session instead" if biggest == "files" else (
            "put large data in a file under allow_read instead")
        raise RequestError(
            f"the request line is {len(data)} bytes, {sizes[biggest]} of them {biggest}; "
            f"the pool reads at most {MAX_LINE_BYTES} bytes (1 MiB) per line{hint}; {instead}",
            biggest,
        )
    return data + b"\n"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _encodable(value: Any) -> bool:
    try:
        _dumps(value).encode("utf-8")
    except (UnicodeEncodeError, TypeError, ValueError):
        return False
    return True
