"""What the doc tests share: a shell block's ``$ `` commands, each with the lines it printed."""

from __future__ import annotations


def prompt_examples(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) of each ``$ `` line: the lines up to the next prompt."""
    found = []
    for i, line in enumerate(lines):
        if line.startswith("$ "):
            expected = []
            for after in lines[i + 1 :]:
                if after.startswith("$ "):
                    break
                expected.append(after)
            found.append((line[2:], expected))
    return found
