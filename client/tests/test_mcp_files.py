"""``readie mcp``'s files, the pure layer: a model's ``files`` argument as bytes, and a result's
collected files and displayed image as the MCP contents a model reads, within their bounds. What the
tool does with them over a pool is test_mcp.py's (engine) and test_mcp_runsc.py's (a real sandbox).
"""

from __future__ import annotations

import base64

import pytest
from mcp.types import ImageContent, TextContent
from readie._mcp_files import (
    MAX_IMAGE_BYTES,
    MAX_SHOWN_IMAGES,
    MAX_TEXT_FILE_CHARS,
    Base64File,
    Shown,
    file_contents,
    model_files,
)
from readie_protocol.events import Result, Value

import readie

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40
JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 40


def result(collected=None, left_out=(), left_out_more=0, value=None) -> Result:
    return Result(id=1, exit=0, collected=collected, left_out=left_out, left_out_more=left_out_more, value=value)


def test_a_models_files_are_text_or_base64():
    files = model_files({"data/a.csv": "a,b\n1,2\n", "logo.png": Base64File(base64=base64.b64encode(PNG).decode())})
    assert files == {"data/a.csv": b"a,b\n1,2\n", "logo.png": PNG}
    assert model_files(None) == {}
    with pytest.raises(readie.RequestError, match="'x.bin': is not valid base64") as bad:
        model_files({"x.bin": Base64File(base64="not base64!")})
    assert bad.value.field == "files"
    with pytest.raises(readie.RequestError, match="lone surrogate"):
        model_files({"x.txt": "\ud800"})


def test_images_and_text_come_back_as_contents_and_the_rest_is_named():
    shown = Shown()
    shown.sent({"in.csv": b"a\n"})
    outcome = result(
        collected={
            "in.csv": b"a\n",  # sent by the call, unchanged: not shown back
            "out/chart.png": PNG,
            "photo.JPEG": JPEG,
            "notes.md": "# Total\n12 €\n".encode(),
            "report.xlsx": b"PK\x03\x04\x00\xff",
            "big.png": b"\x89PNG" + b"\x00" * MAX_IMAGE_BYTES,
        },
        left_out=(readie.LeftOut("huge.csv", "size", 10**9), readie.LeftOut("link.txt", "link")),
        left_out_more=3,
        value=Value("<PIL.Image>", data={"image/png": base64.b64encode(PNG).decode(), "text/html": "<img>"}),
    )
    contents, notes = file_contents(outcome, shown)
    assert [type(c) for c in contents] == [ImageContent, ImageContent, ImageContent, TextContent]
    assert [(c.mime_type, base64.b64decode(c.data)) for c in contents[:3]] == [
        ("image/png", PNG), ("image/png", PNG), ("image/jpeg", JPEG)]
    assert contents[3].text == "--- notes.md ---\n# Total\n12 €\n"
    assert notes == [
        "the value's image/png: shown as an image",
        f"out/chart.png ({len(PNG)} bytes): shown as an image",
        f"photo.JPEG ({len(JPEG)} bytes): shown as an image",
        "notes.md (15 bytes): shown as text",
        "report.xlsx (6 bytes): not text, not shown",
        f"big.png ({MAX_IMAGE_BYTES + 4} bytes): not shown, an image is shown up to {MAX_IMAGE_BYTES} bytes",
        "huge.csv (1000000000 bytes): not brought back (too large for what one call brings back)",
        "link.txt: not brought back (a symbolic link, never followed)",
        "3 more files not brought back",
    ]
    # The same workspace again (a session's next call): only what changed is shown.
    again = dict(outcome.collected, **{"notes.md": b"changed"})
    contents, notes = file_contents(result(collected=again), shown)
    assert [c.text for c in contents] == ["--- notes.md ---\nchanged"]


def test_what_is_shown_is_bounded():
    many = {f"fig{n}.png": PNG + bytes([n]) for n in range(MAX_SHOWN_IMAGES + 2)}
    long_text = "x" * (MAX_TEXT_FILE_CHARS + 5)
    contents, notes = file_contents(result(collected={**many, "log.txt": long_text.encode()}), Shown())
    assert sum(isinstance(c, ImageContent) for c in contents) == MAX_SHOWN_IMAGES
    assert sum("not shown, 16 files or 8 images are shown at most" in note for note in notes) == 2
    assert contents[-1].text == f"--- log.txt ---\n{'x' * MAX_TEXT_FILE_CHARS}\n[... 5 more characters cut]"


def test_a_displayed_image_that_is_not_base64_is_not_passed_on():
    contents, notes = file_contents(result(value=Value("x", data={"image/jpeg": "%%%"})), Shown())
    assert contents == [] and notes == ["the value's image/jpeg: not valid base64, not shown"]
