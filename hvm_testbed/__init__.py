"""The project's test bed, kept out of the installed library: run from a checkout.

- :mod:`.launch`: ``horovodrun`` command lines for local ranks over Gloo or MPI, and a
  bounded child process (its whole process group killed at a deadline), for the real
  multi-rank tests and benchmarks.
- :mod:`.cluster`: several emulated hosts on one machine (root only), each a network
  namespace with its own rate-limited link and an sshd, so that ``horovodrun -H`` and the
  job scripts start ranks over ssh as on a real cluster
  (``python -m hvm_testbed.cluster up 3 --rate 1gbit``).

A compressor's author tests against :mod:`horovod_micro.testing.loopback`, which is installed.
"""
