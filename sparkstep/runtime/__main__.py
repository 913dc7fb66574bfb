"""``python -m sparkstep.runtime``: see :mod:`sparkstep.runtime.process`."""

import sys

from sparkstep.runtime.process import main

sys.exit(main())
