"""peft_slim's version (kept in step with ``pyproject.toml``), recorded in every config it saves."""

__version__ = "0.1.0"
