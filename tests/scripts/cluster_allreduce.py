"""One rank of the emulated-cluster test: allreduce 2**20 floats valued rank+1 and print
``RESULT rank size hostname first last`` so the test can check the sum and the host."""

import socket
import sys

import horovod.torch as hvd
import torch

hvd.init()
total = hvd.allreduce(torch.full((1 << 20,), float(hvd.rank() + 1)), op=hvd.Sum,
                      name="cluster.allreduce")
# One write: unbuffered print() writes each field apart, and mpirun's output tags would
# land between them.
sys.stdout.write(f"RESULT {hvd.rank()} {hvd.size()} {socket.gethostname()} "
                 f"{float(total.min())} {float(total.max())}\n")
sys.stdout.flush()
