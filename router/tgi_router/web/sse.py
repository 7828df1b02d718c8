"""Server-sent event payloads built without a pydantic model per token."""

import json


def compact_json(value) -> bytes:
    """Compact JSON with non-ASCII text as UTF-8: for plain values (strings,
    ints, bools, None) the bytes pydantic writes; a float has the same value
    but may be spelled differently (1e-05 against 1e-5)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
