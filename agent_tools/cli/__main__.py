"""``python -m agent_tools.cli``: the same as the ``attention-explainer`` console script."""

import sys

from agent_tools.cli import main

sys.exit(main())
