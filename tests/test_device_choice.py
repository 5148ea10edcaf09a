"""The bounded controller's choice made on the device (what a GPU runs, with no host read)
against the rule's plain statement (simulation.BoundedRule), case by case: where the
device decides (a count in the band, upward, a cliff), it decides as the rule does; where
only the host can (a count below the band, a crossing beyond the window, more than the
slots), it says RESELECT."""

import math

import pytest
import torch
from simulation import BoundedRule

from horovod_micro.compressors.micro.compressor import rms
from horovod_micro.compressors.micro.device_choice import LEVELS, RESELECT, choose_in_slots
from horovod_micro.compressors.micro.drift import drift_scores
from horovod_micro.compressors.micro.part_controller import PartController
from horovod_micro.selection import ThresholdSelector

NUMEL, DENSITY, OFFSET = 4000, 0.02, 7


def _segment(case: str, seed: int) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    if case == "cliff":  # a tenth of the entries within 0.01 % of each other
        x[::10] = 2.5 * (1 + 1e-4 * torch.rand(NUMEL // 10, generator=torch.Generator()
                                              .manual_seed(seed)))
    return x


def _both(x: torch.Tensor, shift: float, slots: int, capacity: int, monkeypatch):
    """(the rule's threshold, step and selection; the device's choice) for a multiplier
    ``shift`` ladder steps off the start, on one part of ``NUMEL`` entries."""
    monkeypatch.setenv("HOROVOD_MICRO_SELECT", "torch")
    rule = BoundedRule(DENSITY, NUMEL, 1)
    rule.log_m[0] += shift * math.log(rule.q)
    threshold = rule.threshold(0, 0, x, [(0, NUMEL)])
    want = torch.nonzero(x.abs() >= threshold).view(-1)

    # The device side, under test: the library's controller given the rule's multiplier
    # (its state, not its rule, so that both start from the same place).
    controller = PartController(math.floor(DENSITY * NUMEL), [NUMEL], DENSITY)
    controller.log_multipliers = list(rule.log_m)
    scale = rms(torch.dot(x, x), NUMEL, 1.0)
    th0 = controller.base_threshold(0, scale)
    target = controller.part_target(0)
    selector = ThresholdSelector()
    padded = torch.cat([torch.zeros(OFFSET), x])  # the part starts at OFFSET
    choice = choose_in_slots(selector.scores(padded[OFFSET:]).abs(), th0, capacity,
                             controller, target, slots, OFFSET, NUMEL + OFFSET)
    return threshold, rule.reports[-1], want, target, choice


def _branch(x: torch.Tensor, shift: float, want: int, slots: int, capacity: int) -> str:
    """Which of the rule's cases ``x`` meets, from the rule's definition (the count at the
    base threshold against the target) and what the device can hold: a crossing within
    LEVELS steps up, a selection within the slots, and at a cliff the scores at or above
    the highest step that still counts round(target) within the buffer."""
    rule = BoundedRule(DENSITY, NUMEL, 1)
    base = math.exp(rule.log_m[0] + shift * math.log(rule.q)) * math.sqrt(
        float(x.double().pow(2).sum()) / NUMEL)
    target = rule.target(NUMEL)

    def count(j: int) -> int:
        return int((x.abs() >= base * rule.q ** j).sum())

    c0 = count(0)
    if c0 >= target and count(LEVELS) > target:
        return "beyond"
    if want > slots:
        return "overflow"
    cut = BoundedRule(DENSITY, NUMEL, 1)
    cut.log_m[0] += shift * math.log(rule.q)
    cut.threshold(0, 0, x, [(0, NUMEL)])
    m = max(round(target), 1)
    if cut.exact_cuts and count(max(j for j in range(-LEVELS, LEVELS + 1)
                                    if count(j) >= m)) > max(capacity, slots):
        return "buffer"
    return "upward" if c0 >= target else ("band" if c0 >= target / 1.1 else "below")


WIDE = 10_000  # slots enough for any selection here
BUFFER = 4 * math.floor(DENSITY * NUMEL) + 64  # the selection's buffer, as MiCRO sizes it

CASES = [("gauss", 1, 1.0, WIDE, BUFFER, "band"), ("gauss", 3, 2.0, WIDE, BUFFER, "band"),
         ("gauss", 1, 0.0, WIDE, BUFFER, "upward"), ("gauss", 2, 0.0, WIDE, BUFFER, "upward"),
         ("gauss", 2, -20.0, WIDE, BUFFER, "upward"),
         ("cliff", 1, -20.0, WIDE, BUFFER, "upward"),
         ("cliff", 2, -20.0, WIDE, BUFFER, "upward"), ("gauss", 1, 6.0, WIDE, BUFFER, "below"),
         ("gauss", 2, 12.0, WIDE, BUFFER, "below"), ("gauss", 2, 80.0, WIDE, BUFFER, "below"),
         ("cliff", 1, 0.0, WIDE, BUFFER, "below"), ("cliff", 2, 6.0, WIDE, BUFFER, "below"),
         ("cliff", 1, -20.0, 100, 100, "buffer"),
         ("gauss", 1, -140.0, WIDE, WIDE, "beyond"), ("gauss", 2, -200.0, WIDE, WIDE, "beyond"),
         ("gauss", 1, -20.0, 50, BUFFER, "overflow")]


@pytest.mark.parametrize("case,seed,shift,slots,capacity,branch", CASES)
def test_the_device_decides_as_the_rule_or_leaves_it_to_the_host(case, seed, shift, slots,
                                                                 capacity, branch,
                                                                 monkeypatch):
    x = _segment(case, seed)
    threshold, step, want, _, choice = _both(x, shift, slots, capacity, monkeypatch)
    assert _branch(x, shift, want.numel(), slots, capacity) == branch  # as it says
    if branch in ("beyond", "overflow", "buffer"):
        assert int(choice.report) == RESELECT
        return
    count = int(choice.count)
    assert int(choice.report) == step
    assert float(choice.threshold) == pytest.approx(threshold, rel=1e-6)
    assert count == want.numel()
    assert choice.slots[:count].tolist() == (want + OFFSET).tolist()
    assert not choice.slots[count:].any()  # unused slots hold 0


def test_a_cliff_is_cut_on_the_device():
    """The cliff cases above are cut by the rule (its exact cut, the round(target)-th
    largest), so the device's kthvalue is what matched."""
    for seed in (1, 2):
        rule = BoundedRule(DENSITY, NUMEL, 1)
        rule.log_m[0] -= 20.0 * math.log(rule.q)
        rule.threshold(0, 0, _segment("cliff", seed), [(0, NUMEL)])
        assert rule.exact_cuts == 1


@pytest.mark.parametrize("judge", ["magnitude", "drift"])
def test_the_choice_traces_as_one_graph(judge):
    """The drift score and the whole device-side choice are one graph for torch._dynamo:
    no host read and no shape that depends on the data (what a CUDA graph can capture)."""
    x = _segment("gauss", 1)
    controller = PartController(80, [NUMEL], DENSITY)
    last = torch.randint(-200, 0, (NUMEL,), dtype=torch.int16)

    def choose(segment, th0):
        scores = drift_scores(segment, last, 1, 50.0) if judge == "drift" else segment
        choice = choose_in_slots(scores.abs(), th0, BUFFER, controller, 80.0, 96, 0, NUMEL)
        return choice.slots, choice.count, choice.report, choice.threshold

    explained = torch._dynamo.explain(choose)(x, torch.tensor(2.3, dtype=torch.float64))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_the_step_between_backward_and_the_gathers_traces_as_one_graph():
    """What a MiCRO step runs on the device before the index gather (the reducer's check:
    the squared norm and the status word; the scale and the base threshold; the choice;
    the block with its header) is one graph for torch._dynamo, and so is the value
    allreduce's input between the two gathers: no host read and no shape that depends on
    the data, in the order the reducer calls them."""
    from horovod_micro.compressors.micro.compressor import values_in_slots
    from horovod_micro.exchange import slots_block
    from horovod_micro.reducer import status_word
    from horovod_micro.status import OK

    acc = torch.cat([torch.zeros(OFFSET), _segment("gauss", 3)])
    controller = PartController(80, [NUMEL], DENSITY)
    slots = 96

    def before_gather(acc, previous_scale):
        sq_norm = torch.dot(acc, acc)
        word = status_word(acc, OK, sq_norm, 5, 1e30)
        th0 = controller.base_threshold(0, rms(sq_norm, acc.numel(), previous_scale))
        choice = choose_in_slots(acc[OFFSET:].abs(), torch.where(th0 > 0.0, th0, math.inf),
                                 BUFFER, controller, controller.part_target(0), slots,
                                 OFFSET, acc.numel())
        return slots_block(choice.slots, word, choice.count, choice.report, choice.count)

    explained = torch._dynamo.explain(before_gather)(acc, torch.tensor(1.0,
                                                                       dtype=torch.float64))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    block = before_gather(acc, torch.tensor(1.0, dtype=torch.float64))
    assert block.shape == (4 + slots,)  # the block of one fixed shape, every step

    gathered = torch.stack([block[4:], block[4:].flip(0)])  # two ranks' slots
    valid = torch.arange(slots) < torch.tensor([[int(block[1])], [3]])
    explained = torch._dynamo.explain(values_in_slots)(
        acc, gathered, valid, lambda v: v.to(torch.float16))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    values = values_in_slots(acc, gathered, valid, lambda v: v)
    expected = torch.where(valid, acc[gathered.long()], 0).view(-1)
    assert torch.equal(values, expected)


def test_the_step_after_the_value_allreduce_traces_as_one_graph():
    """The buffers' writes after the exchange (error feedback keeps what the wire lost where
    this rank's value went, the output is cleared at the last support and takes the
    aggregate) are one graph for torch._dynamo, with float16 on the wire, and write what a
    plain statement of the step says. Their shapes follow the union's size, so a CUDA graph
    would still need it fixed."""
    from horovod_micro.reducer import write_aggregate

    gen = torch.Generator().manual_seed(5)
    acc, output = torch.randn(NUMEL, generator=gen), torch.zeros(NUMEL)
    previous = torch.randperm(NUMEL, generator=gen)[:50]
    output[previous] = 1.0
    union = torch.randperm(NUMEL, generator=gen)[:80]
    values = torch.randn(80, generator=gen)

    def wire_error(sent):
        return sent - sent.to(torch.float16).float()

    explained = torch._dynamo.explain(write_aggregate)(
        acc.clone(), output.clone(), union, union, values, wire_error, previous)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1

    before, want_out = acc.clone(), torch.zeros(NUMEL)
    want_acc = acc.clone()
    want_acc[union] = acc[union] - acc[union].half().float()
    want_out[union] = values
    sent, kept = write_aggregate(acc, output, union, union, values, wire_error, previous)
    assert torch.equal(acc, want_acc) and torch.equal(output, want_out)
    assert torch.equal(sent, before[union]) and torch.equal(kept, want_acc[union])
