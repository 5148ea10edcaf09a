"""Body of every rank started by :func:`multirank.run_ranks` (not a test module).

argv: ``module:function``, JSON kwargs, output directory.
"""

import importlib
import json
import os
import sys
import traceback
from pathlib import Path


def main() -> None:
    target, kwargs, out_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    module_name, func_name = target.split(":")
    try:
        value = getattr(importlib.import_module(module_name), func_name)(**kwargs)
        result = {"ok": True, "value": value}
    except BaseException as error:  # noqa: BLE001  every failure is reported, then judged
        result = {"ok": False, "error_type": type(error).__name__,
                  "message": f"{error}\n{traceback.format_exc()}"}
    tmp = out_dir / f".rank{rank}.json"
    tmp.write_text(json.dumps(result))
    tmp.rename(out_dir / f"rank{rank}.json")
    sys.stdout.flush()
    sys.stderr.flush()
    if not result["ok"]:
        # Do not wait in hvd.shutdown() for ranks that may never come.
        os._exit(0)


if __name__ == "__main__":
    main()
