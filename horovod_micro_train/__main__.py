"""``horovodrun -np 2 -H localhost:2 --gloo python -m horovod_micro_train [flags]``: see
:mod:`horovod_micro_train.cli`."""

import sys

from .trainer import main

sys.exit(main())
