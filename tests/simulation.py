"""Independent single-process references for the multi-rank tests, and the gradient feeder.

The references are plain torch, written from the algorithm's definition, not from
horovod_micro's code: n workers live in one process as n residual vectors, and every
collective is a Python sum or concatenation.

``feed_gradients`` is what the rank bodies use to drive a real ``hvm.DistributedOptimizer``
with known per-rank gradients: one flat parameter whose ``.grad`` is set to
``rank_gradient(rank, t)`` before each ``synchronize()``.
"""

from __future__ import annotations

import math

import torch


def rank_gradient(rank: int, iteration: int, numel: int, seed: int = 0,
                  skew: float = 0.0, dtype: torch.dtype = torch.float32,
                  plateau: float = 0.0) -> torch.Tensor:
    """Deterministic gradient of ``rank`` at ``iteration`` (float32 unless ``dtype``).

    Heavy-tailed (Student-t like) values; ``skew > 0`` makes magnitudes grow along the
    vector, so later parts hold more large entries (unbalanced parts). A float64 gradient
    is drawn in float64, so it has digits that a float32 round trip would lose.
    ``plateau > 0``: that share of the entries (the same ones every time) are replaced by
    +-0.03 within 0.01 % of each other: a cliff in the count against the threshold, far
    narrower than one step of the bounded controller's ladder.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + iteration * 104_729)
    draw = torch.float64 if dtype == torch.float64 else torch.float32
    normal = torch.randn(numel, generator=gen, dtype=draw)
    chi = torch.randn(numel, 3, generator=gen, dtype=draw).pow(2).sum(1).div(3).sqrt()
    values = normal / chi * 0.01
    if skew:
        values *= torch.exp(torch.linspace(0.0, skew, numel, dtype=draw))
    if plateau:
        where = torch.Generator().manual_seed(seed)
        spots = torch.randperm(numel, generator=where)[:round(plateau * numel)]
        level = 0.03 * (1.0 + 1e-4 * torch.rand(len(spots), generator=gen, dtype=draw))
        values[spots] = torch.where(values[spots] < 0, -level, level)
    return values.to(dtype)


def injected_gradient(rank: int, iteration: int, numel: int, seed: int = 0,
                      dtype: torch.dtype = torch.float32, inject=()) -> torch.Tensor:
    """``rank_gradient`` with entries overwritten: ``inject`` holds
    ``[iteration, rank, index, value]`` items (``rank`` None: every rank)."""
    grad = rank_gradient(rank, iteration, numel, seed, dtype=dtype)
    for when, who, index, value in inject:
        if when == iteration and who in (None, rank):
            grad[index] = value
    return grad


def identity(values: torch.Tensor) -> torch.Tensor:
    return values


def fp16_round_trip(values: torch.Tensor) -> torch.Tensor:
    """What a value is after travelling as float16 (``fp16_values``)."""
    return values.half().to(values.dtype)


def allreduce_sum(values: list[torch.Tensor], wire=identity) -> torch.Tensor:
    """What an allreduce of the ranks' ``values`` sums when they travel through ``wire``:
    with float16 values Horovod adds in float16, so every partial sum is rounded (overflow
    included). Exact for 2 ranks; with more the order of a ring's additions may differ."""
    total = wire(values[0])
    for v in values[1:]:
        total = wire(total + wire(v))
    return total


def exchange_outcome(acc: list[torch.Tensor], union: torch.Tensor, aggregate: torch.Tensor,
                     sent: list[torch.Tensor], wire=identity, error_feedback: bool = True):
    """The applied gradient and every rank's next residual, once a method has decided the
    coordinates ``union`` (int64) and their ``aggregate``; ``sent[r]``: the coordinates
    whose value rank r put into the aggregate. The rules (docs/failure-modes.md,
    "Non-finite gradients"):

    * a finite step: the aggregate at ``union``, 0 elsewhere; rank r's residual is its
      ``a_t`` except at ``sent[r]``, where it keeps what the wire lost, ``a - wire(a)``
      (0 in full precision, the float16 rounding error with ``fp16_values``);
    * a non-finite step (a NaN/Inf in some rank's ``a_t`` or in the aggregate): NaN
      everywhere; each residual keeps its ``a_t`` with the non-finite entries and the
      coordinates of non-finite aggregates set to 0, nothing else.

    Returns ``(gradient, residuals, finite)``.
    """
    finite = bool(torch.isfinite(aggregate).all()) and all(
        bool(torch.isfinite(a).all()) for a in acc)
    out = torch.zeros_like(acc[0])
    residual = [a.clone() for a in acc]
    if finite:
        out[union] = aggregate
        for res, a, s in zip(residual, acc, sent):
            res[s] = a[s] - wire(a[s])
    else:
        out.fill_(math.nan)
        bad = union[~torch.isfinite(aggregate)]
        for res in residual:
            torch.nan_to_num_(res, nan=0.0, posinf=0.0, neginf=0.0)
            res[bad] = 0.0
    if not error_feedback:
        residual = [torch.zeros_like(a) for a in acc]
    return out, residual, finite


def contiguous_parts(numel: int, n: int) -> list[tuple[int, int]]:
    """n contiguous ranges covering [0, numel), the first numel % n one longer."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for p in range(n):
        end = start + base + (p < extra)
        bounds.append((start, end))
        start = end
    return bounds


def drift_score(acc: torch.Tensor, age: torch.Tensor, wait: float) -> torch.Tensor:
    """MiCRO's drift judge stated plainly: ``|a| * sqrt(wait / age)``, in ``acc``'s dtype
    (float32 arithmetic for float32: ``wait / age``, its correctly rounded square root,
    times ``|a|``)."""
    ratio = torch.tensor(wait, dtype=acc.dtype) / age.to(acc.dtype)
    return acc.abs() * torch.sqrt(ratio.double()).to(acc.dtype)  # correctly rounded


def simulate_micro(grads: list[list[torch.Tensor]], thresholds, n: int,
                   average: bool = True, error_feedback: bool = True,
                   probe: float = 1.25, wire=identity, judge: str = "magnitude",
                   density: float | None = None, capacity: int | None = None) -> list[dict]:
    """MiCRO on n simulated workers. ``grads[t][r]`` is rank r's gradient at iteration t
    (any float dtype: the residuals and the result take it).

    ``thresholds[t]``: the threshold of iteration t, one number for every rank (the
    shared-threshold controllers) or a list with one per rank (the scale-free ones, whose
    thresholds differ from rank to rank); or a :class:`BoundedRule`, which decides every
    rank's threshold from its ``a_t`` as the default controller does.

    Returns per iteration: the aggregated gradient, each rank's selection, each rank's
    residual after the exchange, how many selected entries reach ``probe`` times the
    threshold (what the density controller measures its slope from), and whether the step
    was finite (:func:`exchange_outcome`).

    ``judge="drift"`` (needs ``density``): the owner selects ``|a| sqrt(wait / age) >=
    threshold`` instead, where ``age`` counts the iterations since each coordinate was
    last applied (a finite step that aggregated it) and ``wait = min(1 / density, t + 1)``.

    ``capacity``: at most that many coordinates per rank travel; of a selection larger than
    that, the ``capacity`` with the highest judged scores. ``picked`` records the counts
    before that cut, which are what the controller learns from.
    """
    numel = grads[0][0].numel()
    parts = contiguous_parts(numel, n)
    residual = [torch.zeros(numel, dtype=grads[0][0].dtype) for _ in range(n)]
    history = []
    rule = thresholds if isinstance(thresholds, BoundedRule) else None
    if rule:
        density = rule.density
    applied_at = torch.zeros(numel, dtype=torch.long)  # iteration after the last application
    for t in range(len(grads) if rule else len(thresholds)):
        acc = [(residual[r] if error_feedback else 0) + grads[t][r] for r in range(n)]
        age = t + 1 - applied_at
        wait = min(1.0 / density, float(t + 1)) if judge == "drift" else None
        judged = ([drift_score(a, age, wait) for a in acc] if judge == "drift"
                  else [a.abs() for a in acc])
        if rule:
            threshold = [rule.threshold(t, r, acc[r], parts, judged[r]) for r in range(n)]
        else:
            threshold = thresholds[t]
        per_rank = threshold if isinstance(threshold, list | tuple) else [threshold] * n
        selections, picked = [], []
        for r in range(n):
            start, end = parts[(t + r) % n]
            hits = judged[r][start:end] >= per_rank[r]
            chosen = torch.nonzero(hits).view(-1) + start
            picked.append(len(chosen))
            if capacity is not None and len(chosen) > capacity:
                best = torch.topk(judged[r][chosen], capacity).indices
                chosen = chosen[best.sort().values]
            selections.append(chosen)
        if rule:
            rule.observe(picked)
        above_probe = sum(int((acc[r][sel].abs() >= per_rank[r] * probe).sum())
                          for r, sel in enumerate(selections))
        union = torch.cat(selections)
        summed = allreduce_sum([acc[r][union] for r in range(n)], wire)
        out, residual, finite = exchange_outcome(acc, union, summed / n if average else summed,
                                                 [union] * n, wire, error_feedback)
        if finite:
            applied_at[union] = t + 1
        history.append({"grad": out, "selections": selections, "picked": picked,
                        "above_probe": above_probe,
                        "thresholds": per_rank,
                        "residual": [x.clone() for x in residual], "finite": finite})
    return history


def per_rank_thresholds(traces: list[list[dict]], key: str = "threshold") -> list[list]:
    """``thresholds[t][r]`` from every rank's per-iteration records ``traces[r][t]``."""
    return [[trace[t][key] for trace in traces] for t in range(len(traces[0]))]


class NewtonRule:
    """``controller="newton"`` stated from its definition (docs/design.md, "The density
    controllers"), in plain Python: one threshold ``t`` shared by every rank, starting at
    ``1/(2 sqrt(k))``. After each step with global count ``c`` (and ``c_p``, the count at
    ``1.25 t``), the tail slope ``alpha`` (start 4) moves 30 % of the way, in logs, toward
    ``log(c / max(c_p, 1/2)) / log 1.25`` clamped to ``[0.5, 30]`` (when ``c >= 8``); the
    error is ``e = log(max(c, 1/2) / k)``. Once a count has come within a factor 2 of ``k``
    (engaged), the integral ``E`` adds ``c / k - 1`` every step and ``log t`` moves by
    ``(0.5 e + 0.3 E) / alpha`` clamped to ``log 4``; before that by ``0.5 e / alpha``,
    clamped to ``log 32``."""

    def __init__(self, k: int):
        self.k = float(k)
        self.threshold = 1.0 / (2.0 * math.sqrt(k))
        self.alpha, self.integral, self.engaged = 4.0, 0.0, False

    def update(self, count: int, above_probe: int) -> float:
        if count >= 8:
            slope = math.log(count / max(float(above_probe), 0.5)) / math.log(1.25)
            slope = min(max(slope, 0.5), 30.0)
            self.alpha = math.exp(0.7 * math.log(self.alpha) + 0.3 * math.log(slope))
        error = math.log(max(float(count), 0.5) / self.k)
        self.engaged = self.engaged or abs(error) < math.log(2.0)
        if self.engaged:
            self.integral += count / self.k - 1.0
            step, bound = (0.5 * error + 0.3 * self.integral) / self.alpha, math.log(4.0)
        else:
            step, bound = 0.5 * error / self.alpha, math.log(32.0)
        self.threshold = math.exp(math.log(self.threshold) + min(max(step, -bound), bound))
        return self.threshold


class BoundedRule:
    """The default controller (``controller="bounded"``) stated from its definition
    (docs/design.md, "The density controllers"), in plain Python: each part p has a multiplier
    ``m_p`` (start: the Gaussian ``Phi^-1(1 - d/2)``); the owner's base threshold is
    ``m_p * rms(a_t)``; on the ladder ``base * 2**(j/64)`` it takes the step whose count
    in its part is closest to the part's target ``max(k* |p| / N, 1)`` (log ratio, ties toward
    j = 0), searching upward from a count at or above the target, keeping the base for a
    count in ``[target / 1.1, target)``, and searching ``[-J, 0]`` below that, with
    ``J = min(max(ceil(log(1.5 target / max(c, 1/2)) / (2 log q)), 1), 128)``. Every rank
    then moves ``log m_p`` by ``0.5 (j - 4) log q`` for the part it reported (clamped to
    128 steps) and ``k* = k (1 - 0.2 * sum_t (k_t / k - 1))``, clamped to [0.5 k, 1.5 k].
    When the chosen step's count is more than 10 % off the target although some scanned
    step had at least the target, the threshold is the ``round(target)``-th largest ``|a|``
    of the part instead (the report stays the step).
    Counts are found by scanning the whole ladder range (no search)."""

    q = 2.0 ** (1.0 / 64.0)

    def __init__(self, density: float, numel: int, n: int):
        from statistics import NormalDist

        self.k = math.floor(density * numel)
        self.density = density
        self.numel, self.n = numel, n
        self.log_m = [math.log(NormalDist().inv_cdf(1 - density / 2))] * n
        self.excess = 0.0
        self.reports: list[int] = []
        self.parts: list[int] = []
        self.exact_cuts = 0  # thresholds taken as the round(target)-th largest |a|

    def target(self, part_size: int) -> float:
        factor = min(max(1.0 - 0.2 * self.excess, 0.5), 1.5)
        return max(self.k * factor * part_size / self.numel, 1.0)

    def threshold(self, t: int, r: int, acc: torch.Tensor, parts,
                  judged: torch.Tensor | None = None) -> float:
        """Rank r's threshold; ``judged``: what the owner ranks (``|a|``, or the drift
        score), while the scale stays ``rms(a)``."""
        if r == 0:
            self.reports, self.parts = [], []
        p = (t + r) % self.n
        start, end = parts[p]
        values = (acc.abs() if judged is None else judged)[start:end]
        base = math.exp(self.log_m[p]) * math.sqrt(float(acc.double().pow(2).sum()) / acc.numel())
        target = self.target(end - start)

        def count(j: int) -> int:
            return int((values >= base * self.q ** j).sum())

        def err(j: int) -> float:
            return abs(math.log(max(count(j), 0.5) / target))

        c0 = count(0)
        if c0 >= target:
            steps, j = [0], 0
            while count(j) > 0:
                j += 1
                steps.append(j)
        elif c0 >= target / 1.1:
            steps = [0]
        else:
            depth = math.ceil(math.log(1.5 * target / max(c0, 0.5)) / (2 * math.log(self.q)))
            steps = list(range(-min(max(depth, 1), 128), 1))
        best = min(steps, key=lambda j: (err(j), abs(j)))
        self.reports.append(best)
        self.parts.append(p)
        if err(best) > math.log(1.1) and count(min(steps)) >= target:
            # More than 10 % off even at the closest step: the round(target)-th largest |a|.
            self.exact_cuts += 1
            return float(values.sort(descending=True).values[max(round(target), 1) - 1])
        return base * self.q ** best

    def observe(self, counts: list[int]) -> None:
        self.excess += sum(counts) / self.k - 1.0
        limit = 128 * math.log(self.q)
        for j, p in zip(self.reports, self.parts):
            step = 0.5 * (j - 4) * math.log(self.q)
            self.log_m[p] += min(max(step, -limit), limit)


def feed_gradients(opt, param: torch.nn.Parameter, rank: int, iterations: int,
                   numel: int, seed: int = 0, skew: float = 0.0, step: bool = True,
                   inject=(), plateau: float = 0.0):
    """Drive ``opt`` with ``rank_gradient`` (in ``param``'s dtype, with ``inject`` as in
    :func:`injected_gradient`) for ``iterations`` exchanges; yield per iteration
    (exchanged gradient, stats, residual after the exchange)."""
    for t in range(iterations):
        param.grad = (injected_gradient(rank, t, numel, seed, param.dtype, inject) if inject
                      else rank_gradient(rank, t, numel, seed, skew, param.dtype, plateau))
        opt.synchronize()
        grad = param.grad.detach().clone()
        residual = opt.state_dict()["horovod_micro"]["residual"]
        yield grad, opt.last_stats, residual
        if step:
            with opt.skip_synchronize():
                opt.step()
        opt.zero_grad()


def simulate_micro_ahead(grads: list[list[torch.Tensor]], rule: BoundedRule, n: int,
                         guess: float, capacity: int, average: bool = True) -> list[dict]:
    """``micro_ahead`` on n simulated workers, stated plainly: step t applies the union
    ``U_t`` chosen at step t - 1 (nothing at t = 0), with every rank's ``a_t`` there summed;
    at step t each rank r chooses ``U_{t+1}`` in the part it owns at t + 1,
    ``(t + 1 + r) mod n``, ranking ``e_{t+1} + guess * g_t`` (the residual this step leaves
    plus the gradient, ``a_t - e_t``; no guess at t = 0) by the drift score at iteration
    t + 1 (ages after ``U_t`` was applied), with the threshold of ``rule`` at the scale of
    its ``a_t``, cut to the ``capacity`` highest scores. Finite gradients only."""
    numel = grads[0][0].numel()
    parts = contiguous_parts(numel, n)
    residual = [torch.zeros(numel, dtype=grads[0][0].dtype) for _ in range(n)]
    union = torch.zeros(0, dtype=torch.long)
    applied_at = torch.zeros(numel, dtype=torch.long)
    history = []
    for t in range(len(grads)):
        before = residual
        acc = [before[r] + grads[t][r] for r in range(n)]
        summed = allreduce_sum([acc[r][union] for r in range(n)])
        out, residual, _ = exchange_outcome(acc, union, summed / n if average else summed,
                                            [union] * n)
        applied_at[union] = t + 1
        age = t + 2 - applied_at
        wait = min(1.0 / rule.density, float(t + 2))
        selections, picked, thresholds = [], [], []
        for r in range(n):
            judged = residual[r] + guess * (acc[r] - before[r]) if t else residual[r]
            scores = drift_score(judged, age, wait)
            threshold = rule.threshold(t + 1, r, acc[r], parts, scores)
            start, end = parts[(t + 1 + r) % n]
            chosen = torch.nonzero(scores[start:end] >= threshold).view(-1) + start
            picked.append(len(chosen))
            if len(chosen) > capacity:
                best = torch.topk(scores[chosen], capacity).indices
                chosen = chosen[best.sort().values]
            selections.append(chosen)
            thresholds.append(threshold)
        rule.observe(picked)
        history.append({"grad": out, "applied": union, "selections": selections,
                        "picked": picked, "thresholds": thresholds,
                        "residual": [x.clone() for x in residual]})
        union = torch.cat(selections)
    return history
