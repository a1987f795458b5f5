"""Escaping for anything a peer supplied before it is written to a log.

The codec already restricts ids to safe character sets, but log lines also show
text the door does not constrain (exception messages that quote a peer's field
names, an ErrorReply's detail, a socket address). A CR forges a log line, an
ANSI escape rewrites the operator's terminal and a NUL truncates the file for
some readers, so every log call that shows peer data passes it through `shown`.
"""

from __future__ import annotations

import re

# Printable ASCII except the backslash, which is escaped too so an escape in
# the output is always ours and never the peer's.
_UNSAFE = re.compile(r"[^\x20-\x5b\x5d-\x7e]")
DEFAULT_LIMIT = 256


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    if code == 0x5C:
        return "\\\\"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def shown(value: object, limit: int = DEFAULT_LIMIT) -> str:
    """`value` as printable ASCII, cut to `limit` characters first so the work stays bounded."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) > limit
    return _UNSAFE.sub(_escape, text[:limit]) + ("..." if cut else "")
