"""Helpers for testing a sparsifier, the project's own and a user's.

- :mod:`.loopback`: n simulated ranks in one process, one thread each, with Horovod's
  collective semantics: a method's exchange runs for n ranks in milliseconds, for the
  inner loop of writing it.
- :mod:`.launch`: ``horovodrun`` command lines for local ranks over Gloo or MPI, and a
  bounded child process (its whole process group killed at a deadline), for the real
  multi-rank tests and benchmarks.
"""
