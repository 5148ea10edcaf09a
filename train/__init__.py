"""Training entrypoints reproducing the MiCRO paper's experiments under ``horovodrun``.

``python -m train --help`` (see :mod:`train.cli`) trains; ``python -m train.plot`` draws
figures from recorded runs. Models live in :mod:`train.models`.
"""
