"""Helpers for testing a compressor, the project's own and a user's.

- :mod:`.loopback`: n simulated ranks in one process, one thread each, with Horovod's
  collective semantics: a compressor's exchange runs for n ranks in milliseconds, for the
  inner loop of writing it.
- :mod:`.launch`: ``horovodrun`` command lines for local ranks over Gloo or MPI, and a
  bounded child process (its whole process group killed at a deadline), for the real
  multi-rank tests and benchmarks.
- :mod:`.cluster`: several emulated hosts on one machine (root only), each a network
  namespace with its own rate-limited link and an sshd, so that ``horovodrun -H`` and the
  job scripts start ranks over ssh as on a real cluster
  (``python -m horovod_micro.testing.cluster up 3 --rate 1gbit``).
"""
