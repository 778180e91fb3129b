"""``readie sessions``: an operator's view of a session store (decision 32).

    readie sessions --session-store /var/lib/readie/sessions --session-store-key /etc/readie/store.key
    readie sessions ... remove 3f2a9c01        # one entry, by a unique prefix of its hash
    readie sessions ... remove --expired       # every expired or invalid entry (what a worker's sweep does)

Lists each entry: the hash that names it (never the session's key, which
the store does not hold), the worker that wrote it, its bytes, the time since
it was last used, and its state: ``leased`` (a worker holds it live),
``stored`` (waiting for an attach), ``foreign`` (written under another store
key, by its key id: never removed for failing this key's check, only once
past the TTL by its mtime, or by its hash from here), ``expired`` (past the
TTL, or holding nothing), ``invalid`` (failed verification: its MAC needs
the key, hence ``--session-store-key``) or ``unreadable`` (this machine failed
to read it just now: an I/O error, no descriptors left; kept). A leased entry is never removed from
here: its worker holds it, and closing the session there removes it. What
the store holds is anyone's text who can write the volume: the table shows
it escaped (``\x1b``, never a terminal's control character), JSON escapes it
as JSON does.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from readie_policy.cli_flags import positive_duration
from readie_protocol.units import format_size

from .errors import ReadieError
from .session_store import DEFAULT_STORE_TTL_S, EntryInfo, SessionStore, read_store_key

EXIT_USAGE = 2
EXIT_NOT_FOUND = 1
# An entry named by fewer hex digits than this is too easy to name by mistake.
MIN_PREFIX_CHARS = 8
# The hash as the listing shows it: enough to be unique in any real store, and to paste back.
SHOWN_HASH_CHARS = 16


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args((sys.argv[1:] if argv is None else argv)[1:])  # argv[0] is "sessions"
    if args.session_store is None or args.session_store_key is None:
        sys.stderr.write("readie sessions: --session-store and --session-store-key are needed (the key verifies each entry)\n")
        return EXIT_USAGE
    try:
        store = SessionStore(args.session_store, read_store_key(args.session_store_key), worker="readie-sessions",
                             ttl_s=args.session_store_ttl, keep_leases=False)
    except ReadieError as exc:
        sys.stderr.write(f"readie sessions: {exc}\n")
        return EXIT_USAGE
    try:
        if args.action == "remove":
            return _remove(store, args)
        _list(store.entries(), as_json=args.json)
        return 0
    finally:
        store.close()


def _list(entries: list[EntryInfo], *, as_json: bool) -> None:
    if as_json:
        for info in entries:
            sys.stdout.write(json.dumps(asdict(info)) + "\n")
        return
    rows = [("ENTRY", "STATE", "WORKER", "SIZE", "AGE")]
    for info in entries:
        age = "-" if info.age_s is None else f"{int(info.age_s)}s"
        rows.append((info.entry[:SHOWN_HASH_CHARS], info.state, escaped(info.worker or "-"), format_size(info.bytes), age))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        sys.stdout.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() + "\n")


def _remove(store: SessionStore, args: argparse.Namespace) -> int:
    if args.expired:
        removed = store.sweep()
        sys.stdout.write(f"removed {len(removed)} expired or invalid entries (another store key's are kept until they expire)\n")
        return 0
    prefix = (args.entry or "").lower()
    if len(prefix) < MIN_PREFIX_CHARS:
        sys.stderr.write(f"readie sessions remove: name an entry by at least {MIN_PREFIX_CHARS} hex digits of its hash, or --expired\n")
        return EXIT_USAGE
    matches = [info for info in store.entries() if info.entry.startswith(prefix)]
    if len(matches) != 1:
        sys.stderr.write(f"readie sessions remove: {len(matches)} entries start with {escaped(prefix)}\n")
        return EXIT_NOT_FOUND if not matches else EXIT_USAGE
    [info] = matches
    if info.state == "leased":
        sys.stderr.write(f"readie sessions remove: {escaped(prefix)} is held live by {escaped(info.worker or '?')}; close the session there\n")
        return EXIT_USAGE
    store.remove_entry(info.entry)
    sys.stdout.write(f"removed {info.entry[:SHOWN_HASH_CHARS]}\n")
    return 0


def escaped(text: str) -> str:
    """``text`` with every character that is not printable ASCII as a backslash escape."""
    return "".join(char if char.isascii() and char.isprintable() else char.encode("unicode_escape").decode() for char in text)


def add_session_store_arguments(parser: argparse.ArgumentParser) -> None:
    """--session-store and --session-store-key: the store's dir and its MAC key (decision 32)."""
    parser.add_argument(
        "--session-store", type=Path, metavar="DIR",
        help="a session store shared with other workers (a ReadWriteMany volume): sessions a drain or a broken "
        "stream leaves go there, for any of them to attach (default: one in the state dir, forgotten at exit)",
    )
    parser.add_argument(
        "--session-store-key", type=Path, metavar="FILE",
        help="the store's MAC key: at least 32 bytes, mode 600, the same file on every worker of the store",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="readie sessions", description="list or remove the sessions in a session store")
    add_session_store_arguments(parser)
    parser.add_argument(
        "--session-store-ttl", type=positive_duration, default=DEFAULT_STORE_TTL_S, metavar="DURATION",
        help="what counts as expired: the workers' --session-store-ttl (default %(default)s seconds)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per entry instead of a table")
    parser.add_argument("action", nargs="?", choices=("list", "remove"), default="list")
    parser.add_argument("entry", nargs="?", help="remove: the entry, by a unique prefix of its hash")
    parser.add_argument("--expired", action="store_true", help="remove: every expired or invalid entry")
    return parser
