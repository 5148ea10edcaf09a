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
