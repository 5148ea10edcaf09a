"""Soak: 2,000 MiCRO steps on real Gloo ranks with nothing growing.

After a warm-up, every rank's resident memory may grow by at most 5 MB over the rest of
the run, and its open file descriptors and threads must stay exactly constant (read from
/proc/self on each rank: tests/ranks_soak.py). No time bound is asserted. The rank count
is ``HVM_SOAK_RANKS`` (default 2; BENCHMARKS.md, "Soak and elastic reset", reports a run
at 8 ranks, oversubscribed on 2 cores).
"""

import os

from multirank import run_ranks

STEPS, WARMUP, EVERY = 2000, 200, 100
RSS_GROWTH_KB = 5 * 1024


def test_soak_nothing_grows_after_warmup():
    ranks = int(os.environ.get("HVM_SOAK_RANKS", "2"))
    results = run_ranks("ranks_soak:soak", np=ranks, kwargs={"steps": STEPS,
                                                             "sample_every": EVERY},
                        timeout=300 + 120 * ranks)  # a hang bound only
    for r in results:
        v = r.value
        assert v["iterations"] == STEPS and v["size"] == ranks and v["weights_equal"]
        assert 0.005 < v["mean_density"] < 0.02  # it really ran MiCRO at d = 0.01
        after = [s for s in v["samples"] if s["step"] >= WARMUP]
        base = after[0]
        growth = max(s["rss_kb"] for s in after) - base["rss_kb"]
        print(f"rank {r.rank}: rss {v['samples'][0]['rss_kb']} kB at step 0, "
              f"{base['rss_kb']} kB at step {WARMUP}, max growth "
              f"{growth} kB, final {after[-1]['rss_kb']} kB; threads {base['threads']}, "
              f"fds {base['fds']}")
        assert growth <= RSS_GROWTH_KB, (r.rank, after)
        assert {s["threads"] for s in after} == {base["threads"]}, (r.rank, after)
        assert {s["fds"] for s in after} == {base["fds"]}, (r.rank, after)
