"""Bad inputs after wrapping, on 2 real Gloo ranks: what every rank
sees. docs/failure-modes.md, "Bad inputs", tabulates these with the earlier tests' cases.

* parameters added to or removed from the wrapped optimizer, or unfrozen after being
  frozen at wrapping time: every rank raises (sparse: ``CollectiveInputError`` through the
  exchange's status, also when one rank alone changed its optimizer; dense: the ranks that
  changed it raise ``ValueError``);
* ``requires_grad`` toggled between steps on every rank: training goes on, the ranks stay
  identical; on one rank only: ``CollectiveInputError`` on every rank (sparse); dense
  exchanges do not notice, and the ranks' weights part, which the test records;
* one rank calling ``step()`` once more than the others: its last exchange has no
  partner. If the others have finished, Horovod's shutdown ends its wait with
  ``HorovodInternalError``; if they wait in another collective,
  the arrival deadline (``HOROVOD_MICRO_ARRIVAL_TIMEOUT_SECONDS``, set short here) ends it
  with ``ExchangeTimeout`` (Gloo), and
  its exit then ends the others' wait with ``HorovodInternalError``; on MPI, Horovod's
  stall shutdown (``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``) ends both waits.
"""

import pytest
from multirank import run_ranks

CHANGED = "parameters changed after wrapping"
FROZEN = "disagree on which parameters require a gradient"

#: (case, sparse, on every rank) -> (error type or None, words in every rank's message)
SWEEP = {
    ("param_added", True, True): ("CollectiveInputError", ["rank 0: ", "rank 1: ", CHANGED,
                                                           "added after wrapping"]),
    ("param_added", True, False): ("CollectiveInputError", ["rank 1: ", CHANGED]),
    ("param_added", False, True): ("ValueError", ["added after wrapping", "wrap the optimizer"]),
    ("param_removed", True, True): ("CollectiveInputError", [CHANGED, "removed after "
                                                             "wrapping: 2.bias"]),
    ("param_removed", True, False): ("CollectiveInputError", ["rank 1: ", CHANGED]),
    ("unfrozen_after_wrapping", True, True): ("CollectiveInputError", [
        CHANGED, "frozen when wrapped, now requiring a gradient: 0.bias"]),
    ("unfrozen_after_wrapping", False, True): ("ValueError", ["frozen when wrapped"]),
    ("frozen_unfrozen", True, True): (None, []),
    ("frozen_unfrozen", False, True): (None, []),
    ("frozen", True, False): ("CollectiveInputError", [FROZEN]),
    ("frozen", False, False): (None, []),
}


def test_bad_inputs_after_wrapping():
    cases = [list(key) for key in SWEEP]
    results = run_ranks("ranks_bad_inputs:sweep", np=2, kwargs={"cases": cases}, timeout=400)
    for (case, sparse, everyone), (error, words) in SWEEP.items():
        key = f"{case}/{'sparse' if sparse else 'dense'}/{'all' if everyone else 'one'}"
        for r in results:
            got = r.value[key]
            assert got["raised"] == error, (r.rank, key, got)
            for word in words:
                assert word in got["message"], (r.rank, key, got["message"])
        if error is None:
            seen = [r.value[key] for r in results]
            # Toggled on every rank: identical ranks, and the weight trains again once
            # unfrozen. Toggled on one rank of a dense exchange: nothing notices, and the
            # ranks part (recorded here so that the table of docs/failure-modes.md stays true).
            assert all(v["same_on_all_ranks"] == (case != "frozen") for v in seen), (key, seen)
            if case == "frozen_unfrozen":
                assert all(v["watched_moved"] for v in seen), (key, seen)
    # The rank that changed its optimizer alone says how, the other does not.
    for key in ("param_added/sparse/one", "param_removed/sparse/one"):
        assert "(this rank: " in results[1].value[key]["message"]
        assert "(this rank: " not in results[0].value[key]["message"]


STALL = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"}


@pytest.mark.parametrize("then,backend_,env,errors", [
    ("exit", "gloo", {}, [None, "HorovodInternalError"]),
    ("barrier", "gloo", {"HOROVOD_MICRO_ARRIVAL_TIMEOUT_SECONDS": "20",
                         "HOROVOD_MICRO_EXCHANGE_TIMEOUT_SECONDS": "20"},
     ["HorovodInternalError", "ExchangeTimeout"]),
    ("barrier", "mpi", STALL, ["HorovodInternalError", "HorovodInternalError"]),
], ids=["exit-gloo", "barrier-gloo", "barrier-mpi"])
def test_one_rank_steps_once_more(then, backend_, env, errors):
    """Rank 1 calls step() once more while rank 0 has finished (``exit``) or waits in
    another collective (``barrier``): a clear error, never a hang. On Gloo our own timeout
    ends the wait (Horovod's stall check does not, there); on MPI Horovod's stall
    shutdown does."""
    results = run_ranks("ranks_bad_inputs:extra_step_then", np=2, kwargs={"then": then},
                        backend=backend_, env=env, timeout=300)
    assert [r.value["raised"] for r in results] == errors, [r.value for r in results]
    if "HOROVOD_MICRO_ARRIVAL_TIMEOUT_SECONDS" in env:
        assert "no other rank joined" in results[1].value["message"]
        assert "step() or synchronize() was called more often" in results[1].value["message"]
    assert "Horovod has been shut down" in [r for r in results if r.value["raised"]
                                            == "HorovodInternalError"][0].value["message"]
