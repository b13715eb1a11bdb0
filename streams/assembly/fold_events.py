"""A turn-log record as the fold reads it: its pydantic event, or, for the common
token-carrying events, the wire decoder's ``WireTokens`` (issue 28 item 2).

``decode_fold_event(data, wire=True)`` tries ``wire_turns.decode_token_event`` first (a
``generation``, ``generation_chunk``, ``observation`` or ``segment_started`` of the current
schema, decoded by msgspec) and falls back to ``turns.decode_turn_event`` for every record it
does not cover, so schema evolution, unknown fields and dead-letter reasons stay pydantic's.
Either way the fold folds the same values into the same records
(``tests/assembly/test_wire_fold.py``).
"""

from __future__ import annotations

from rolloutbus.schemas.turns import TurnEvent, decode_turn_event
from rolloutbus.schemas.wire_turns import WireTokens, decode_token_event

FoldEvent = TurnEvent | WireTokens


def decode_fold_event(data: bytes, *, wire: bool = True) -> FoldEvent:
    """``data`` as the fold reads it; raises what ``decode_turn_event`` raises.
    ``wire=False``: pydantic's decode alone (the baseline the benchmark and tests compare)."""
    if wire:
        event = decode_token_event(data)
        if event is not None:
            return event
    return decode_turn_event(data)
