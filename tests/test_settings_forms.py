"""A compressor setting written in another form on another rank: ``np.int64(7)`` beside
``7``, ``np.True_`` beside ``True`` (one setting, the ranks train alike), ``0`` beside
``False``, ``True`` beside ``1.0`` (refused: a flag is a bool, a number is not a bool),
and a method's own ``-0.0`` beside ``0.0`` (refused: equal in value, but the
collectives' names would differ). Each pair compares equal with ``==``; none may leave
the ranks waiting in differently named collectives until a deadline.

The arrival deadline is set short so that a wait ends the run quickly instead of after
the default 30 minutes."""

import numpy as np
import pytest
from multirank import run_ranks

import horovod_micro as hvm

SHORT_DEADLINE = {"HOROVOD_MICRO_ARRIVAL_TIMEOUT_SECONDS": "30"}

#: case -> words in every rank's ValueError (None: the ranks train alike)
CASES = {
    "randomk_numpy_seed": None,
    "numpy_bool_flag": None,
    "int_flag": ["rank 0: topk: fp16_values must be True or False, got 0"],
    "bool_initial_threshold": ["rank 0: micro: initial_threshold must be a positive finite "
                               "number, got True"],
    "plugin_negative_zero": ["rank 1: compression", "'offset': -0.0",
                             "equal in value to rank 0's", "not in type or form"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_setting_in_another_form_on_another_rank_never_waits(case):
    results = run_ranks("ranks_settings_forms:settings_forms", np=2, kwargs={"case": case},
                        env=SHORT_DEADLINE)
    words = CASES[case]
    for r in results:
        assert r.value["seconds"] < 20, r.value
        if words is None:
            assert r.value["raised"] is None and r.value["same_weights"], r.value
        else:
            assert r.value["raised"] == "ValueError", r.value
            assert all(w in r.value["message"] for w in words), r.value
    assert results[0].value["message"] == results[1].value["message"]


def test_settings_take_numpy_scalars_and_refuse_bools_for_numbers():
    """NumPy integers are integers and NumPy bools are flags, held as Python ones; a bool
    is no number and a number no flag."""
    seed = hvm.Compression.randomk(density=0.01, seed=np.int64(7)).seed
    assert seed == 7 and type(seed) is int
    flags = hvm.Compression.topk(density=0.01, error_feedback=np.False_, fp16_values=np.True_,
                                 momentum_masking=np.True_)
    assert (flags.error_feedback, flags.fp16_values, flags.momentum_masking) == (
        False, True, True)
    assert all(type(f) is bool for f in (flags.error_feedback, flags.fp16_values,
                                         flags.momentum_masking))
    assert hvm.Compression.powersgd(warm_start=np.False_).warm_start is False
    threshold = hvm.Compression.threshold(value=np.float32(0.5))
    assert type(threshold.lam) is float and threshold.lam == 0.5
    for make, words in [
            (lambda: hvm.Compression.micro(density=0.01, controller="newton",
                                           initial_threshold=True), "initial_threshold"),
            (lambda: hvm.Compression.micro(density=0.01, controller="newton",
                                           initial_threshold=float("inf")), "initial_threshold"),
            (lambda: hvm.Compression.randomk(density=0.01, seed=np.bool_(True)), "seed"),
            (lambda: hvm.Compression.topk(density=0.01, error_feedback=1), "error_feedback"),
            (lambda: hvm.Compression.cltk(density=0.01, fp16_values=1.0), "fp16_values"),
            (lambda: hvm.Compression.threshold(value=0.5, error_feedback=0), "error_feedback"),
            (lambda: hvm.Compression.threshold(value=0.5, momentum_masking=1),
             "momentum_masking"),
            (lambda: hvm.Compression.powersgd(fp16_values=1), "fp16_values")]:
        with pytest.raises(ValueError, match=words):
            make()
