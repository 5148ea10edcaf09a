"""Training entrypoints reproducing the MiCRO paper's experiments under ``horovodrun``.

``python -m horovod_micro_train --help`` (see :mod:`horovod_micro_train.cli`) trains; ``python
-m horovod_micro_train.plot`` draws figures from recorded runs. Models live in
:mod:`horovod_micro_train.models`.
"""
