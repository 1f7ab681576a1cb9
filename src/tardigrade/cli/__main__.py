"""``python -m tardigrade.cli``: the same as the ``tardigrade`` command."""

import sys

from . import main

sys.exit(main())
