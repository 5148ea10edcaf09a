"""``horovodrun -np 2 -H localhost:2 --gloo python -m train [flags]``: see :mod:`train.cli`."""

import sys

from .trainer import main

sys.exit(main())
