"""CLI: YAML + flag precedence, --dry-run, and one-line errors with exit code 2."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

from raytrain import fit
from raytrain.models import SeedCNN
from tests.helpers import read_only_dir


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("lr: 0.2\nepochs: 3\noptim:\n  batch_size: 32\ndataset: digits\n")
    cfg = fit.resolve(fit.build_parser().parse_args(["--config", str(cfg_file), "--lr", "0.01"]))
    assert cfg.optim.lr == 0.01          # flag beats YAML
    assert cfg.optim.epochs == 3         # YAML beats default
    assert cfg.optim.batch_size == 32    # sectioned YAML works too
    assert cfg.optim.momentum == 0.9     # default
    assert cfg.data.dataset == "digits"


def test_dry_run_prints_resolved_config_and_per_worker_batch(tmp_path, capsys):
    rc = fit.main(["--dry-run", "--num-workers", "4", "--batch-size", "256", "--dataset",
                   "digits", "--storage-path", str(tmp_path), "--name", "x"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "256 global = 64 per worker x 4 workers" in out
    assert "lr: 0.05" in out and "num_workers: 4" in out
    assert not os.path.exists(tmp_path / "x")  # started nothing, wrote nothing


def test_help_groups_the_flags_by_dataclass_with_one_example_each(tmp_path):
    from raytrain.config import FIELDS, GROUPS, own_fields

    parser = fit.build_parser()
    groups = {g.title: g for g in parser._action_groups}
    assert [t for t in groups if t in GROUPS] == ["run", "data", "model", "optimisation",
                                                  "recipe", "Tune", "cluster", "storage",
                                                  "tracking"]
    grouped = []
    for title, cls in GROUPS.items():
        own = {f.name for f in own_fields(cls)}
        assert own <= {a.dest for a in groups[title]._group_actions}, title
        grouped += own
        doc, example = groups[title].description.split("\n  e.g. ")
        assert doc and example.startswith("python -m raytrain.fit "), title
        argv = example.split()[3:]
        if "--data-dir" in argv:  # the example's folder: python -m raytrain.pack --from digits
            (tmp_path / "digits-folder").mkdir()
            argv[argv.index("--data-dir") + 1] = str(tmp_path / "digits-folder")
        args = parser.parse_args(argv)
        assert own & set(vars(args)), f"{title}'s example uses none of its flags"
        fit.resolve(args)  # a valid config
    assert sorted(grouped) == sorted(FIELDS)  # every setting in exactly one group
    assert parser.format_help().count("  e.g. python -m raytrain.fit ") == len(GROUPS)


def test_elastic_workers_parse():
    cfg = fit.resolve(fit.build_parser().parse_args(["--num-workers", "2:4",
                                                     "--batch-size", "64"]))
    assert cfg.cluster.num_workers == (2, 4) and cfg.per_worker_batch == 16


def _bad_inputs(tmp):
    bad_yaml = tmp / "bad.yaml"
    bad_yaml.write_text("lr: [1, 2\n")
    unknown = tmp / "unknown.yaml"
    unknown.write_text("learning_rate: 0.1\n")
    bad_lr_yaml = tmp / "badlr.yaml"
    bad_lr_yaml.write_text("lr: -1\n")
    not_weights = tmp / "notweights.pt"
    not_weights.write_text("hello")
    pickled = tmp / "plain.pkl"  # a plain pickle, not torch.save's format
    pickled.write_bytes(pickle.dumps({"w": {1, 2}}, protocol=4))
    wrong_shape = tmp / "wrong.pt"
    torch.save({"conv1.weight": torch.zeros(1)}, wrong_shape)
    readonly = tmp / "ro"  # read-only for root too: tests/helpers.read_only_dir
    return [
        (["--num-workers", "0"], "--num-workers"),
        (["--num-workers", "-2"], "--num-workers"),
        (["--num-workers", "two"], "--num-workers"),
        (["--num-workers", "4:2"], "MIN:MAX"),
        (["--epochs", "0"], "--epochs"),
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "2", "--num-workers", "4"], "--batch-size"),
        (["--lr", "0"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "inf"], "--lr"),
        (["--model", "nosuchnet"], "resnet18"),
        (["--dataset", "mnist"], "cifar10, cifar100, digits, synthetic"),
        (["--optimizer", "rmsprop"], "sgd, adamw"),
        (["--lr-schedule", "step"], "constant, cosine, onecycle"),
        (["--pretrained", str(tmp / "missing.pt")], "--pretrained"),
        (["--pretrained", str(not_weights), "--dataset", "digits"],
         "--pretrained: got '%s'; expected a torch weights file (state_dict) loadable with "
         "weights_only=True; not a file torch.save wrote (" % not_weights),
        (["--pretrained", str(pickled), "--dataset", "digits"],
         "it holds Python objects other than tensors (refused, nothing was run)"),
        (["--pretrained", str(wrong_shape), "--dataset", "digits"], "--pretrained"),
        (["--data-dir", str(tmp / "nodir")], "--data-dir"),
        (["--config", str(tmp / "missing.yaml")], "--config"),
        (["--config", str(bad_yaml)], "--config"),
        (["--config", str(unknown)], "learning_rate (in unknown.yaml)"),
        (["--config", str(bad_lr_yaml)], "lr (in badlr.yaml)"),
        (["--epochs", "2.5"], "--epochs"),
        (["--storage-path", "hdfs://bucket/runs"], "--storage-path"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["--storage-path", str(readonly / "runs"), "--dataset", "digits"], "--storage-path"),
    ]


def test_every_bad_input_is_one_line_exit_2(tmp_path, capsys):
    with read_only_dir(tmp_path / "ro"):
        _check_bad_inputs(tmp_path, capsys)


def _check_bad_inputs(tmp_path, capsys):
    for argv, expected in _bad_inputs(tmp_path):
        if argv == ["--no-such-flag"]:  # argparse exits itself, with code 2
            with pytest.raises(SystemExit) as exited:
                fit.main(argv + ["--dry-run", "--storage-path", str(tmp_path / "runs")])
            rc = exited.value.code
        else:
            rc = fit.main(argv + ["--dry-run", "--storage-path", str(tmp_path / "runs")]
                          if "--storage-path" not in argv else argv + ["--dry-run"])
        assert rc == 2, argv
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1, (argv, err)
        assert lines[0].startswith("raytrain: error:") and expected in lines[0], (argv, err)
        assert "Traceback" not in err
    assert not os.path.exists(tmp_path / "runs")


def test_tune_dry_run_runs_tunes_checks_too(tmp_path, capsys):
    """--dry-run exits 2 where the real search would (--grace-period above --epochs)."""
    rc = fit.main(["--tune", "--grace-period", "5", "--epochs", "2", "--dataset", "digits",
                   "--num-workers", "1", "--storage-path", str(tmp_path), "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--grace-period" in err[0], err


def test_cli_process_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "raytrain.fit", "--lr", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("raytrain: error: --lr: got -1.0; expected a finite "
                                   "number > 0")


def test_pretrained_weights_load_with_a_new_head(tmp_path):
    donor = SeedCNN(num_classes=100)
    torch.save(donor.state_dict(), tmp_path / "w.pt")
    from raytrain.models import build_model

    model = build_model("seed-cnn", 10, str(tmp_path / "w.pt"))
    assert torch.equal(model.conv1.weight, donor.conv1.weight)
    assert model.fc2.weight.shape == (10, 512)  # the head is new, fc1 is the donor's
    assert torch.equal(model.fc1.weight, donor.fc1.weight)


def test_bad_data_dir_fails_before_any_ray_process(tmp_path, capsys):
    """Corrupt or absent CIFAR data is caught on the driver, not in retried workers."""
    from tests.helpers import write_tiny_cifar

    folder = write_tiny_cifar(tmp_path / "corrupt")
    with open(os.path.join(folder, "test_batch"), "r+b") as f:
        f.truncate(50)
    (tmp_path / "empty").mkdir()
    ray_was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    for data_dir, expected in ((tmp_path / "corrupt", "--data-dir"),
                               (tmp_path / "empty", "the download failed")):
        rc = fit.main(["--dataset", "cifar10", "--data-dir", str(data_dir),
                       "--storage-path", str(tmp_path / "runs")])
        err = capsys.readouterr().err
        assert rc == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "runs")
    assert os.listdir(tmp_path / "empty") == []  # no .cifar10.lock left behind
    if not ray_was_up:  # raytrain started no Ray for it
        assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


# Nothing listens on port 9: a command that tried to reach the cluster would fail on --address.
NOWHERE = ["--address", "127.0.0.1:9"]
UNWRITABLE = "/proc/raytrain-runs"  # /proc takes no new directories, from root either


def _fit_process(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raytrain.fit", *argv], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": ""})


def test_several_failing_checks_are_each_a_line_before_any_ray_process(tmp_path):
    (tmp_path / "c10" / "cifar-10-batches-py").mkdir(parents=True)  # no batches in it
    too_many = str((os.cpu_count() or 1) + 1)  # more than a local cluster of this machine has
    proc = _fit_process("--num-workers", too_many, "--dataset", "cifar10", "--data-dir",
                        str(tmp_path / "c10"), "--storage-path", UNWRITABLE)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 3, proc.stderr
    assert all(ln.startswith("raytrain: error: ") for ln in lines), lines
    assert [ln.split()[2] for ln in lines] == ["--storage-path", "--data-dir:", "--num-workers"]
    assert "Ray dashboard" not in proc.stdout  # no cluster was started


def test_finished_run_and_unwritable_storage_are_answered_without_a_cluster(ray_cluster,
                                                                           tmp_path):
    args = ["--dataset", "digits", "--epochs", "1", "--storage-path", str(tmp_path),
            "--name", "done"]
    assert fit.main(args) == 0
    proc = _fit_process(*args, *NOWHERE)
    assert proc.returncode == 0, proc.stderr
    assert "run done already finished all 1 epochs; nothing to train" in proc.stdout
    proc = _fit_process("--dataset", "digits", "--storage-path", UNWRITABLE, *NOWHERE)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"raytrain: error: --storage-path {UNWRITABLE}: not writable (No such file or "
        "directory)"), proc.stderr
