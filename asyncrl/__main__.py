"""``python -m asyncrl ...``: the ``asyncrl`` command (:mod:`asyncrl.cli`)."""

import sys

from .cli import main

sys.exit(main())
