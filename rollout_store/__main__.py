"""`python -m rollout_store`: the `rollout-store` command."""

import sys

from .cli import main

sys.exit(main())
