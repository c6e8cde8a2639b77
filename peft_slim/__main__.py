"""``python -m peft_slim`` is the ``peft-slim`` command."""

import sys

from .cli import main

sys.exit(main())
