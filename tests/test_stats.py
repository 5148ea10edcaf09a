"""StatsLog writes each record through to the file as it comes (no buffering until close)."""

import json

import horovod_micro as hvm


def test_stats_log_flushes_every_record(tmp_path):
    path = tmp_path / "stats.jsonl"
    with open(path, "w") as stream:
        log = hvm.StatsLog(stream)
        for t in range(2):
            log(hvm.StepStats(iteration=t, method="micro", numel=10, target_count=1,
                              threshold=0.5, rank_counts=[1, 0], global_count=1))
            # Read back through another handle while the stream is still open.
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            assert [r["iteration"] for r in rows] == list(range(t + 1))
            assert rows[-1]["load_imbalance"] == 1.0


def test_phase_clock_splits_a_phase_into_its_collectives():
    """``PhaseClock.split`` replaces a phase by the parts measured inside it plus the rest,
    in place, so ``StepStats.phases`` reads in the order of the step."""
    from horovod_micro.stats import PhaseClock

    clock = PhaseClock()
    clock.seconds = {"select": 1.0, "exchange": 5.0, "update": 2.0}
    clock.split("exchange", {"indices": 3.0, "values": 1.5})
    assert list(clock.seconds) == ["select", "indices", "values", "exchange_local", "update"]
    assert clock.seconds["exchange_local"] == 0.5
    assert clock.total == 8.0
    clock.lap("write_back")
    assert list(clock.seconds)[-1] == "write_back" and clock.seconds["write_back"] >= 0.0


def test_phase_clock_synchronises_before_every_reading():
    """``sync`` (``torch.cuda.synchronize`` in a GPU benchmark) runs before the first
    reading and before every lap, so a phase is charged the kernels it launched."""
    from horovod_micro.stats import PhaseClock

    calls = []
    clock = PhaseClock(sync=lambda: calls.append(len(calls)))
    assert calls == [0]
    clock.lap("accumulate")
    clock.lap("check")
    assert calls == [0, 1, 2] and list(clock.seconds) == ["accumulate", "check"]
