"""Shared-token files (``--token-file``) for the server and the clients that replay against it."""

from __future__ import annotations

from pathlib import Path

from .errors import StreamgrError


def read_token(path: str | None) -> str | None:
    """The token in a file (surrounding whitespace stripped); an empty file is an error, not
    "no auth"."""
    if not path:
        return None
    token = Path(path).read_text().strip()
    if not token:  # an empty token would turn auth off without a word
        raise StreamgrError(f"--token-file {path}: the file holds no token (only whitespace)")
    return token
