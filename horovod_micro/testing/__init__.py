"""Helpers for testing a compressor, the project's own and a user's.

- :mod:`.loopback`: n simulated ranks in one process, one thread each, with Horovod's
  collective semantics: a compressor's exchange runs for n ranks in milliseconds, for the
  inner loop of writing it.

Launching real ranks and emulated hosts belongs to the project's test bed (``hvm_testbed``
in a checkout), not to the installed library.
"""
