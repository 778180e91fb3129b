"""Files through ``readie mcp``'s ``run_python``: what a model sends, and what it gets back.

A model sends ``files`` as JSON: each workspace path maps to its text
(written as UTF-8), or to ``{"base64": "..."}`` for bytes that are not
text. The pool checks the paths and the bounds (64 files, 768 KiB), as for
any job.

What comes back is what the code saved in its workspace (its working
directory) that a model can read: the files ``collect`` matches (by default
:data:`DEFAULT_COLLECT`: images and common text files) and a displayed value's
image (a last bare expression whose ``_repr_png_`` or ``_repr_jpeg_`` the
sandbox rendered). PNG and JPEG become MCP image content, UTF-8 files text
content, each under its own bound; anything else, and whatever passes a
bound, is named in the text with its size, not shown. A file the call
itself sent, unchanged, is not shown back; in a session, neither is one
shown by an earlier call and unchanged since (:class:`Shown` remembers
their digests): a session's workspace keeps every chart it ever drew.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from mcp.types import ContentBlock, ImageContent, TextContent
from pydantic import BaseModel, ConfigDict, Field
from readie_protocol.events import Result
from readie_protocol.workspace import (
    MAX_COLLECT_PATTERNS,
    MAX_REQUEST_FILES,
    MAX_WORKSPACE_PATH_BYTES,
    decode_bytes,
    encode_bytes,
)

from ._errors import RequestError

__all__ = [
    "COLLECT_DESCRIPTION",
    "DEFAULT_COLLECT",
    "FILES_DESCRIPTION",
    "MAX_IMAGE_BYTES",
    "MAX_SHOWN_FILES",
    "MAX_SHOWN_IMAGES",
    "MAX_TEXT_FILE_CHARS",
    "Base64File",
    "CollectArgument",
    "FilesArgument",
    "Shown",
    "describe_files",
    "file_contents",
    "model_files",
]

#: What a call brings back unless the model names its own: the images a model can see and the
#: text files it can read, anywhere in the workspace.
DEFAULT_COLLECT = ("**/*.png", "**/*.jpg", "**/*.jpeg", "**/*.txt", "**/*.md", "**/*.csv", "**/*.json")
#: The image formats MCP clients show a model, by file name.
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
#: Images one call shows: a chart or a few; more would fill the model's context with pictures.
MAX_SHOWN_IMAGES = 8
#: The largest image shown: its base64 (4 MiB) stays under the 5 MB models' APIs take per image.
MAX_IMAGE_BYTES = 3 * 1024 * 1024
#: Files one call shows, images and text together.
MAX_SHOWN_FILES = 16
#: Characters of one text file shown (the rest is cut, and said to be): a page or two of a table,
#: a log's worth; the model reads the rest with code, a slice at a time.
MAX_TEXT_FILE_CHARS = 20_000

FILES_DESCRIPTION = (
    "Files to write into the working directory before the code runs: each relative path maps to "
    "its text (written as UTF-8), or to {\"base64\": \"...\"} for binary content. At most "
    f"{MAX_REQUEST_FILES} files and 768 KiB together."
)
COLLECT_DESCRIPTION = (
    "Files the code saves that come back to you after it ran: relative paths or glob patterns "
    "(*, ?, [...] within a name, ** for any directories). PNG and JPEG files come back as images, "
    "UTF-8 files as text, others are named with their size. Default: "
    f"{', '.join(DEFAULT_COLLECT)}. [] brings nothing back."
)


class Base64File(BaseModel):
    """A file's bytes that are not text, as base64."""

    model_config = ConfigDict(extra="forbid")
    base64: str = Field(description="The file's bytes in base64 (RFC 4648, padded).")


FilesArgument = Annotated[
    dict[str, str | Base64File] | None,
    Field(description=FILES_DESCRIPTION, max_length=MAX_REQUEST_FILES),
]
CollectArgument = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_WORKSPACE_PATH_BYTES)]] | None,
    Field(description=COLLECT_DESCRIPTION, max_length=MAX_COLLECT_PATTERNS),
]


def model_files(files: Mapping[str, str | Base64File] | None) -> dict[str, bytes]:
    """The model's ``files`` as bytes; :class:`~readie.RequestError` names a value that is neither
    UTF-8 text nor base64."""
    out: dict[str, bytes] = {}
    for path, content in (files or {}).items():
        try:
            out[path] = content.encode("utf-8") if isinstance(content, str) else decode_bytes(content.base64)
        except UnicodeEncodeError:
            raise RequestError(f"{path!r}: holds a lone surrogate, which UTF-8 cannot carry", "files") from None
        except ValueError as exc:  # the protocol's Invalid
            raise RequestError(f"{path!r}: {exc}", "files") from None
    return out


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass
class Shown:
    """The digest of every file a model has seen of one workspace (sent or shown), by path: what
    is unchanged is not shown again."""

    digests: dict[str, bytes] = field(default_factory=dict)

    def sent(self, files: Mapping[str, bytes]) -> None:
        self.digests.update((path, _digest(data)) for path, data in files.items())

    def new(self, path: str, data: bytes) -> bool:
        digest = _digest(data)
        if self.digests.get(path) == digest:
            return False
        self.digests[path] = digest
        return True


def file_contents(result: Result, shown: Shown) -> tuple[list[ContentBlock], list[str]]:
    """What ``result`` brings a model beside its text: image and text contents (new ones only, within
    the bounds), and lines for the text naming what was brought back but not shown, and why."""
    contents: list[ContentBlock] = []
    notes: list[str] = []
    images = 0
    if result.value is not None:
        for mime in ("image/png", "image/jpeg"):
            if (encoded := result.value.data.get(mime)) is None:
                continue
            try:
                decode_bytes(encoded)  # the pool's word is checked before a model's client decodes it
            except ValueError:
                notes.append(f"the value's {mime}: not valid base64, not shown")
                continue
            contents.append(ImageContent(type="image", data=encoded, mime_type=mime))
            images += 1
            notes.append(f"the value's {mime}: shown as an image")
            break  # a value offering both is one picture
    for path, data in (result.collected or {}).items():
        if not shown.new(path, data):
            continue
        mime = IMAGE_TYPES.get(_suffix(path))
        if len(contents) >= MAX_SHOWN_FILES or (mime is not None and images >= MAX_SHOWN_IMAGES):
            notes.append(f"{path} ({len(data)} bytes): not shown, {MAX_SHOWN_FILES} files or "
                         f"{MAX_SHOWN_IMAGES} images are shown at most")
        elif mime is not None and len(data) > MAX_IMAGE_BYTES:
            notes.append(f"{path} ({len(data)} bytes): not shown, an image is shown up to {MAX_IMAGE_BYTES} bytes")
        elif mime is not None:
            contents.append(ImageContent(type="image", data=encode_bytes(data), mime_type=mime))
            images += 1
            notes.append(f"{path} ({len(data)} bytes): shown as an image")
        elif (text := _text(data)) is not None:
            cut = len(text) - MAX_TEXT_FILE_CHARS
            body = text[:MAX_TEXT_FILE_CHARS] + (f"\n[... {cut} more characters cut]" if cut > 0 else "")
            contents.append(TextContent(type="text", text=f"--- {path} ---\n{body}"))
            notes.append(f"{path} ({len(data)} bytes): shown as text")
        else:
            notes.append(f"{path} ({len(data)} bytes): not text, not shown")
    for left_out in result.left_out:
        size = "" if left_out.size is None else f" ({left_out.size} bytes)"
        notes.append(f"{left_out.path}{size}: not brought back ({_REASONS.get(left_out.reason, left_out.reason)})")
    if result.left_out_more:
        notes.append(f"{result.left_out_more} more files not brought back")
    return contents, notes


_REASONS = {
    "size": "too large for what one call brings back",
    "count": "too many files",
    "link": "a symbolic link, never followed",
    "not_file": "not a regular file",
    "changed": "it changed while it was read",
    "unreadable": "missing or unreadable",
}


def _suffix(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 else ""


def _text(data: bytes) -> str | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    # NUL is no text a model reads, whatever decodes.
    return None if "\x00" in text else text


def describe_files(notes: list[str]) -> str:
    """The lines the tool's text ends with about the files that came back."""
    return "Files:\n" + "\n".join(f"- {note}" for note in notes)
