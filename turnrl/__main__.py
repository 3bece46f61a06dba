"""``python -m turnrl ...`` (and ``torchrun ... -m turnrl train ...``): the ``turnrl`` command."""

import sys

from turnrl.cli import main

sys.exit(main())
