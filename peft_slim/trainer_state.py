"""Reading a callback's saved attributes back from a Trainer checkpoint's ``trainer_state.json``."""

from __future__ import annotations

from typing import Any


def stored_callback_attribute(state: Any, callback: object, attribute: str) -> Any:
    """``attribute`` as ``callback``'s class saved it in ``state.stateful_callbacks`` (None if absent).

    transformers stores one entry per callback class, a dict or a list of dicts (several instances); the first
    instance's is the one peft_slim's callbacks write.
    """
    stored = state.stateful_callbacks.get(type(callback).__name__)
    if isinstance(stored, list):
        stored = stored[0] if stored else None
    return stored.get("attributes", {}).get(attribute) if isinstance(stored, dict) else None
