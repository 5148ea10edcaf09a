"""The stable CLI of ``python -m horovod_micro_train`` and the recipe it fills in (one process)."""

import pytest

from horovod_micro_train.cli import DATASETS, RECIPES, TrainError, build_parser, parse_args
from horovod_micro_train.schedule import lr_at, peak_lr
from horovod_micro_train.trainer import build_compression


def test_bare_command_is_the_fashion_mnist_main_job():
    args = parse_args([])
    assert (args.dataset, args.model, args.compressor) == ("fashion-mnist", "fmnist_mlp",
                                                           "micro")
    assert (args.epochs, args.density, args.out) == (3, 0.01, "runs/default")
    assert args.batch_size == 64 and parse_args(["--batch-size", "16"]).batch_size == 16
    assert not args.download and args.resume is None and args.data_dir is None


def test_digits_stays_available():
    args = parse_args(["--dataset", "digits"])
    assert (args.model, args.epochs, args.density) == ("digits_cnn", 12, 0.01)
    assert args.batch_size == 32


def test_the_communication_bound_model_is_selectable_for_fashion_mnist():
    args = parse_args(["--model", "wide_mlp"])
    assert (args.dataset, args.model) == ("fashion-mnist", "wide_mlp")


def test_cifar_defaults_are_the_papers_recipe():
    args = parse_args(["--dataset", "cifar10"])
    assert (args.model, args.epochs, args.batch_size, args.lr) == ("resnet18", 200, 32, 0.1)
    assert (args.warmup_epochs, args.lr_decay_epochs, args.lr_decay_factor) == (5, [150], 0.1)
    assert (args.momentum, args.no_nesterov, args.weight_decay) == (0.9, False, 1e-4)
    assert args.density == 0.001
    # lr 0.1 * 32/128 * n; warm-up from the single-worker value; decay at 150.
    peak = peak_lr(args.lr, args.batch_size, 16)
    assert peak == pytest.approx(0.4)
    assert lr_at(0.0, peak, 16, 5, [150], 0.1) == pytest.approx(0.4 / 16)
    assert lr_at(5.0, peak, 16, 5, [150], 0.1) == pytest.approx(0.4)
    assert lr_at(150.0, peak, 16, 5, [150], 0.1) == pytest.approx(0.04)


def test_every_recipe_value_can_be_overridden():
    args = parse_args(["--dataset", "cifar100", "--model", "senet18", "--epochs", "3",
                       "--density", "0.05", "--warmup-epochs", "0", "--lr-decay-epochs",
                       "1", "2", "--workers", "0", "--resume", "--tensorboard"])
    assert (args.model, args.epochs, args.density, args.warmup_epochs) == ("senet18", 3,
                                                                           0.05, 0)
    assert args.lr_decay_epochs == [1, 2] and args.workers == 0
    assert args.resume == "auto" and args.tensorboard
    assert set(RECIPES) == set(DATASETS)
    assert build_parser().get_default("dataset") == "fashion-mnist"


@pytest.mark.parametrize("argv", [["--density", "0"], ["--density", "2"], ["--epochs", "0"],
                                  ["--dataset", "imagenet"], ["--eval-every", "0"],
                                  ["--elastic", "--eval-every", "5"]])
def test_bad_values_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_compressor_names_map_to_horovod_micro():
    import horovod_micro as hvm
    assert build_compression("none", 0.01) is hvm.Compression.none
    assert build_compression("fp16", 0.01) is hvm.Compression.fp16
    assert build_compression("micro", 0.01).density == 0.01
    with pytest.raises(ValueError, match="no Compression.nope .*micro"):
        build_compression("nope", 0.01)


def test_momentum_masking_flag_reaches_the_compressor():
    assert build_compression("micro", 0.01).momentum_masking is None
    assert build_compression("micro", 0.01, None, False).momentum_masking is False
    assert build_compression("micro", 0.01, "paper", False).momentum_masking is False
    assert build_compression("topk", 0.01, None, True).momentum_masking is True
    with pytest.raises(TrainError, match="--momentum-masking applies to sparse methods"):
        build_compression("none", 0.01, None, True)


def test_powersgd_rank_flag_reaches_the_compressor():
    assert build_compression("powersgd", 0.01).rank == 1  # no density: its default rank
    assert build_compression("powersgd", 0.01, powersgd_rank=4).rank == 4
    with pytest.raises(TrainError, match="--powersgd-rank applies to powersgd"):
        build_compression("micro", 0.01, powersgd_rank=2)


def test_compressor_options_reach_any_method():
    """``--compressor-option KEY=VALUE`` passes any keyword the method's factory takes, as a
    Python literal (a bare word stays a string); a keyword it does not take is refused,
    naming what it does take."""
    args = parse_args(["--compressor", "powersgd", "--compressor-option", "rank=3",
                       "--compressor-option", "warm_start=False"])
    assert args.compressor_options == [("rank", 3), ("warm_start", False)]
    built = build_compression("powersgd", 0.01, options=args.compressor_options)
    assert built.rank == 3 and built.warm_start is False
    micro = build_compression("micro", 0.01, options=[("judge", "magnitude")])
    assert micro.judge == "magnitude" and micro.density == 0.01
    assert parse_args(["--compressor-option", "judge=magnitude"]).compressor_options == [
        ("judge", "magnitude")]
    with pytest.raises(TrainError, match="Compression.topk takes no rank"):
        build_compression("topk", 0.01, options=[("rank", 2)])
    with pytest.raises(TrainError, match="the density is --density"):
        build_compression("micro", 0.01, options=[("density", 0.1)])
    with pytest.raises(SystemExit):
        parse_args(["--compressor-option", "rank"])


def test_settings_that_do_not_apply_are_refused(capsys):
    """No density applies to PowerSGD or a dense method: ``--density`` with them is refused
    (as ``--capacity`` with another method is), and the recorded configuration holds no
    density; a keyword set by its flag and by ``--compressor-option`` at once is refused."""
    for method in ("powersgd", "none"):
        with pytest.raises(SystemExit):
            parse_args(["--compressor", method, "--density", "0.5"])
        assert "--density applies to the methods that take a density" in capsys.readouterr().err
        assert parse_args(["--compressor", method]).density is None
    assert parse_args(["--compressor", "micro"]).density == 0.01  # the recipe's
    with pytest.raises(TrainError, match="rank=2 and --powersgd-rank 4 both set it"):
        build_compression("powersgd", None, powersgd_rank=4, options=[("rank", 2)])
    with pytest.raises(TrainError, match="judge='drift' and --judge 'magnitude'"):
        build_compression("micro", 0.01, judge="magnitude", options=[("judge", "drift")])
