"""``python -m asyncrl ...``: the ``asyncrl`` command (:mod:`asyncrl.cli`)."""

import sys

from asyncrl.cli import main

sys.exit(main())
