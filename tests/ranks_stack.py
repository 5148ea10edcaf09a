"""Rank bodies proving the stack: Horovod's own collectives on real ranks."""

import horovod.torch as hvd
import torch


def collectives():
    rank, size = hvd.rank(), hvd.size()
    # Rank r contributes r + 1 elements (and rank 0 a second, empty, gather) so sizes differ.
    mine = torch.arange(rank + 1, dtype=torch.int32) + 100 * rank
    gathered = hvd.allgather(mine, name="stack.gather")
    empty_or_not = torch.ones(rank, dtype=torch.float32)  # rank 0 sends nothing
    gathered_empty = hvd.allgather(empty_or_not, name="stack.gather_empty")
    summed = hvd.allreduce(torch.full((5,), float(rank + 1)), name="stack.sum", op=hvd.Sum)
    averaged = hvd.allreduce(torch.full((3,), float(rank + 1)), name="stack.avg",
                             op=hvd.Average)
    return {"size": size, "rank": rank, "gathered": gathered.tolist(),
            "gathered_empty": gathered_empty.tolist(), "summed": summed.tolist(),
            "averaged": averaged.tolist(), "mpi": hvd.mpi_enabled(), "gloo": hvd.gloo_enabled()}
