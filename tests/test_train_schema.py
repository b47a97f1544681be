"""Multi-hot fields end to end: a schema reader's bags through hps.torch against torch.nn.EmbeddingBag,
and `hps train` on files of a declared schema."""
import bz2
import json
import os
import re
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="hps.torch needs torch (pip install torch)")
pa = pytest.importorskip("pyarrow")
import hps  # noqa: E402
import hps.torch as ht  # noqa: E402
from hps.data import Epochs, SchemaCsv, SyntheticCriteo  # noqa: E402
from hps.train import TrainConfig, train  # noqa: E402

DIM = 4
SCHEMA = {"label": "click", "dense": ["price"], "categorical": ["site"], "multi_hot": {"tags": "|"}}


def write_csv(path, n, seed):
    """Clicks that depend on the site and on whether tag t3 is among the tags."""
    rng = np.random.default_rng(seed)
    lines = ["click,price,site,tags"]
    for _ in range(n):
        site = int(rng.integers(0, 20))
        tags = sorted(set(rng.integers(0, 8, rng.integers(0, 4)).tolist()))
        p = 0.1 + 0.4 * (site < 5) + 0.45 * (3 in tags)
        lines.append(f"{int(rng.random() < p)},{rng.integers(0, 100)},s{site},{'|'.join(f't{t}' for t in tags)}")
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_reader_bags_pool_and_train_like_torch_embedding_bag(tmp_path, mode):
    write_csv(tmp_path / "a.csv", 64, 0)
    batch = next(iter(SchemaCsv(tmp_path / "a.csv", SCHEMA, batch_size=64)))
    (bags,) = batch.bags
    assert (np.diff(bags.offsets) == 0).any() and (np.diff(bags.offsets) > 1).any()  # empty and longer bags
    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=DIM, path=str(tmp_path / "ps"), optimizer=hps.SGD(lr=0.5),
                                                       mem_budget="4MiB"))
    uniq, inverse = np.unique(bags.keys, return_inverse=True)
    ref = torch.nn.EmbeddingBag(len(uniq), DIM, mode=mode)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(ps.pull(uniq)))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    bag = ht.EmbeddingBag(ps, mode=mode)
    offsets = torch.from_numpy(bags.offsets[:-1])
    target = torch.from_numpy(np.random.default_rng(1).standard_normal((len(batch), DIM)).astype(np.float32))
    for _ in range(3):
        out = bag(torch.from_numpy(bags.keys.view(np.int64)), offsets)
        want = ref(torch.from_numpy(inverse.astype(np.int64)), offsets)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        ((out - target) ** 2).sum().backward()
        opt.zero_grad()
        ((want - target) ** 2).sum().backward()
        opt.step()
    torch.testing.assert_close(torch.from_numpy(ps.pull(uniq)), ref.weight.detach(), rtol=1e-5, atol=1e-6)
    ps.close()


def test_ctr_model_with_bags_is_the_mlp_of_pooled_fields(tmp_path):
    write_csv(tmp_path / "a.csv", 16, 2)
    batch = next(iter(SchemaCsv(tmp_path / "a.csv", SCHEMA, batch_size=16)))
    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=DIM, path=str(tmp_path / "ps"), mem_budget="4MiB"))
    model = ht.CtrModel(ps, num_fields=1, num_dense=1, hidden=(8,), num_bags=1, pooling="mean")
    (bags,) = batch.bags
    keys = torch.from_numpy(batch.keys.view(np.int64))
    got = model(keys, torch.from_numpy(batch.dense),
                [(torch.from_numpy(bags.keys.view(np.int64)), torch.from_numpy(bags.offsets[:-1]), None)])
    site = torch.from_numpy(ps.pull(batch.keys.ravel()))
    uniq, inverse = np.unique(bags.keys, return_inverse=True)
    pooled = torch.nn.functional.embedding_bag(torch.from_numpy(inverse.astype(np.int64)),
                                               torch.from_numpy(ps.pull(uniq)), torch.from_numpy(bags.offsets[:-1]),
                                               mode="mean")
    want = model.mlp(torch.cat([site, pooled, torch.from_numpy(batch.dense)], dim=1)).squeeze(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="bags: expected 1 multi-hot fields, got 0"):
        model(keys, torch.from_numpy(batch.dense))
    ps.close()


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_hps_train_learns_from_a_csv_with_a_multi_hot_field(tmp_path, pooling):
    write_csv(tmp_path / "train.csv", 6000, 3)
    write_csv(tmp_path / "eval.csv", 2000, 4)
    cfg = TrainConfig.from_dict({
        "ps": {"dim": DIM, "path": str(tmp_path / "ps"), "mem_budget": "8MiB", "optimizer": {"kind": "adagrad",
                                                                                              "lr": 0.1}},
        "data": {"source": str(tmp_path / "train.csv"), "eval_source": str(tmp_path / "eval.csv"),
                 "batch_size": 256, "eval_examples": 2000, "schema": SCHEMA},
        "hidden": [16], "dense_lr": 0.01, "torch_threads": 1, "pooling": pooling}, "run.toml")
    summary = train(cfg, progress=False)
    assert summary["examples"] == 6000
    # The signal is in the site and in one tag of the bags: both have to reach the model.
    assert summary["final"]["auc"] > 0.75, summary["final"]
    with open(tmp_path / "ps" / "train-summary.json") as f:
        assert json.load(f)["final"]["eval_examples"] == 2000


def test_train_config_schema_errors_name_the_file(tmp_path):
    ps = {"dim": DIM, "path": str(tmp_path / "ps")}
    with pytest.raises(ValueError, match=r"run.toml: unknown field\(s\) data.schema.dense_columns"):
        TrainConfig.from_dict({"ps": ps, "data": {"source": "x.csv", "schema": {"dense_columns": []}}}, "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: data.schema describes files: give data.source too"):
        TrainConfig.from_dict({"ps": ps, "data": {"schema": {"label": "y"}}}, "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: pooling must be \"sum\" or \"mean\""):
        TrainConfig.from_dict({"ps": ps, "pooling": "max"}, "run.toml")


@pytest.mark.parametrize("field,value,message", [
    ("checkpoint_every", -1, "checkpoint_every must be an int >= 0, got -1"),  # trained no batch, ended "finished"
    ("eval_every", -3, "eval_every must be an int >= 0, got -3"),
    ("torch_threads", 1.5, "torch_threads must be an int >= 0, got 1.5"),
    ("helper_nice", -1, r"helper_nice must be an int in \[0, 19\], got -1"),
    ("dense_lr", -1, "dense_lr must be a finite number > 0, got -1"),
    ("dense_lr", float("nan"), "dense_lr must be a finite number > 0, got nan"),
    ("hidden", [64, 0], r"hidden must be a list of layer widths, ints >= 1 \(\[\] for none\), got \[64, 0\]"),
    ("hidden", 64, "hidden must be a list of layer widths"),
    ("seed", "1", r"seed must be an integer from 0 to 2\*\*64 - 1, got '1'"),  # (torch refused it, job made)
    ("seed", 2 ** 70, r"seed must be an integer from 0 to 2\*\*64 - 1, got 1180591620717411303424"),
    ("sysfs", 3, r"sysfs must be a path \(a string\), got 3"),
    ("ps", {"schedule": "herlad"}, r"\[ps\]: schedule must be 'sequential' or 'herald', got 'herlad'"),
    ("ps", {"optimizer": {"kind": "adagrad", "lr": -0.05}}, r"\[ps\]: optimizer: lr must be a finite number > 0"),
    ("ps", {"optimizer": {"kind": "adagrad", "lr": "0.05"}}, r"\[ps\]: optimizer: lr must be a number, got '0.05'"),
    ("ps", {"seed": -1}, r"\[ps\]: seed must be an integer from 0 to 2\*\*64 - 1, got -1"),
    # (the pipeline refused it only once the server had made the job's directory)
    ("ps", {"lookahead": 65}, r"\[ps\]: lookahead must be an int in \[0, 64\] \(batches\), got 65"),
    ("data", {"source": "x.tsv", "format": "parket"}, "data.format must be one of 'tsv', 'parquet', got 'parket'"),
    ("data", {"source": "x.csv", "format": "svm", "schema": {"label": "y"}},
     "data.format must be one of 'csv', 'tsv', 'parquet', 'libsvm' with a schema, got 'svm'"),
    ("data", {"format": "parquet"}, "data.format = 'parquet' is the files' format: give data.source too"),
    # (the reverse: synthetic data's fields with files were read by nothing, without a word)
    ("data", {"source": "x.csv", "zipf_a": 1.3}, r"data.zipf_a describes synthetic data; data.source = 'x.csv' "
                                                 r"reads files: remove it, or set data.source = 'synthetic'"),
    ("data", {"source": ["a.tsv"], "vocab_sizes": [10], "multi_hot": [[10, 2]], "bag_length": "fixed"},
     r"data.vocab_sizes, data.multi_hot and data.bag_length describe synthetic data; data.source = \['a.tsv'\] "
     r"reads files: remove them"),
])
def test_a_bad_top_level_or_ps_value_is_named_with_the_file(tmp_path, field, value, message):
    ps = {"dim": DIM, "path": str(tmp_path / "ps")}
    d = {"ps": dict(ps, **value)} if field == "ps" else {"ps": ps, field: value}  # "data": a table
    with pytest.raises(ValueError, match="^run.toml: " + message):
        TrainConfig.from_dict(d, "run.toml")
    assert TrainConfig.from_dict({"ps": ps, "hidden": [], "checkpoint_every": 0}, "run.toml").hidden == ()


def test_data_format_tsv_with_a_schema_reads_tab_separated_text_whatever_the_name(tmp_path):
    # open_schema takes format="tsv" (tabs unless the schema says), but [data] format = "tsv"
    # with a schema was refused ("must be one of 'csv', 'parquet', 'libsvm' with a schema"),
    # leaving a tab-separated clicks.txt to be split at commas.
    from hps.train import _train_source
    (tmp_path / "clicks.txt").write_text("click\tprice\tsite\n1\t2\ta,b\n0\t3\tc\n")
    cfg = TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "ps")},
                                 "data": {"source": str(tmp_path / "clicks.txt"), "format": "tsv",
                                          "schema": {"label": "click", "dense": ["price"], "categorical": "rest"}}},
                                "run.toml")
    (batch,) = list(_train_source(cfg))
    assert batch.labels.tolist() == [1.0, 0.0] and batch.keys.shape == (2, 1)


def test_hps_train_data_without_a_toml(tmp_path, capsys):
    from hps.cli import main
    write_csv(tmp_path / "train.csv", 1000, 5)
    write_csv(tmp_path / "eval.csv", 300, 6)
    path = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "train.csv"), "--eval-data", str(tmp_path / "eval.csv"),
                 "--label", "click", "--dense", "price", "--path", str(path), "--batch-size", "200",
                 "--no-progress"]) == 0
    out = capsys.readouterr()
    assert f"parameter server in {path}" in out.err
    assert json.loads(out.out)["final"]["eval_examples"] == 300
    with open(path / "train-summary.json") as f:
        assert json.load(f)["examples"] == 1000
    assert main(["train", "--no-progress"]) == 2
    assert "give --config FILE.toml, or --data PATH" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "train.csv"), "--label", "clicked", "--path",
                 str(tmp_path / "other"), "--no-progress"]) == 2
    assert "train.csv: no column 'clicked'" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()  # a bad input leaves nothing behind


@pytest.mark.parametrize("flag,value,message", [
    ("--checkpoint-every", "-1", "must be >= 0, got -1"),  # trained no batch, ended as a success
    ("--eval-every", "-3", "must be >= 0, got -3"),
    ("--devices", "0", "must be >= 1, got 0"),  # (was ignored: the config's devices ran)
])
def test_hps_train_flags_are_checked_as_the_fields_they_override(tmp_path, capsys, flag, value, message):
    from hps.cli import main
    path = tmp_path / "ps"
    with pytest.raises(SystemExit) as e:
        main(["train", "--path", str(path), "--no-progress", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err
    assert not path.exists()


def test_a_ps_flag_that_makes_a_file_value_count_names_the_file_and_flag(tmp_path, capsys):
    # worker_cache_rows = 0 is unused under the file's sequential schedule; --schedule herald
    # reads it, and the server's check named neither the file nor [ps].
    from hps.cli import main
    config = tmp_path / "run.toml"
    config.write_text(f'[ps]\ndim = {DIM}\npath = "{tmp_path / "ps"}"\nworker_cache_rows = 0\n'
                      '[data]\ntrain_examples = 100\neval_examples = 10\nbatch_size = 10\n')
    assert main(["train", "--config", str(config), "--schedule", "herald", "--no-progress"]) == 2
    assert (f"hps train: {config}: [ps] with --schedule herald: worker_cache_rows must be an int >= 1, got 0"
            in capsys.readouterr().err)
    assert not (tmp_path / "ps").exists()


@pytest.mark.parametrize("hierarchical", [False, True])
def test_data_flag_over_a_synthetic_config_refuses_its_synthetic_fields_naming_the_file(tmp_path, capsys,
                                                                                         hierarchical):
    # TrainConfig.from_dict refuses vocab_sizes, multi_hot ... with a data.source of files, but
    # --data put the files in after it: a synthetic config's vocab_sizes was read by nothing.
    from hps.cli import main
    (tmp_path / "train.tsv").write_text("")
    config = tmp_path / "run.toml"
    config.write_text(f'[ps]\ndim = {DIM}\npath = "{tmp_path / "ps"}"\n'
                      '[data]\nvocab_sizes = [10, 20]\nmulti_hot = [[10, 2]]\nbatch_size = 10\n'
                      + ('[hierarchical]\ngroups = 1\n' if hierarchical else ''))
    assert main(["train", "--config", str(config), "--data", str(tmp_path / "train.tsv"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (f"hps train: {config}: data.vocab_sizes and data.multi_hot describe synthetic data; --data "
            f"{tmp_path / 'train.tsv'} reads files: remove them, or leave out --data" in err), err
    assert not (tmp_path / "ps").exists()


def malformed_csv_run(tmp_path, data_lines: str):
    """run.toml in tmp_path: train.csv with eval.csv held out (the schema of
    write_csv), the job at run/, and `data_lines` more of [data]."""
    config = tmp_path / "run.toml"
    config.write_text(f"""hidden = [8]
torch_threads = 1
[ps]
dim = {DIM}
path = "{tmp_path / 'run'}"
mem_budget = "8MiB"
[data]
source = "{tmp_path / 'train.csv'}"
eval_source = "{tmp_path / 'eval.csv'}"
batch_size = 64
{data_lines}
[data.schema]
label = "click"
dense = ["price"]
categorical = ["site"]
multi_hot = {{ tags = "|" }}
""")
    return config


def test_hps_train_reports_the_lines_skip_malformed_left_out(tmp_path, capsys):
    # With skip_malformed = true a run had trained on fewer examples than the files
    # hold without a word of it: neither the table nor train-summary.json counted
    # the skipped lines. Both now give the count and the first line's message, for
    # the training files and the held-out ones.
    from hps.cli import main
    write_csv(tmp_path / "train.csv", 300, 7)
    write_csv(tmp_path / "eval.csv", 100, 8)
    for name, bad in (("train.csv", [5, 40, 41]), ("eval.csv", [10])):
        lines = (tmp_path / name).read_text().splitlines()
        for i in bad:
            lines[i - 1] = "2,1,s1,t1"  # a label that is not 0 or 1
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    config = malformed_csv_run(tmp_path, "skip_malformed = true")
    assert main(["train", "--config", str(config), "--no-progress"]) == 0
    err = capsys.readouterr().err
    first = f"{tmp_path / 'train.csv'}:5: column 'click': '2' is not 0 or 1"
    assert f"malformed lines skipped (train)  3; the first: {first}" in err
    assert f"malformed lines skipped (eval)   1; the first: {tmp_path / 'eval.csv'}:10: column 'click'" in err
    with open(tmp_path / "run" / "train-summary.json") as f:
        summary = json.load(f)
    assert summary["examples"] == 300 - 3
    assert summary["skipped_lines"]["train"]["malformed"] == 3
    assert summary["skipped_lines"]["train"]["malformed_examples"][0] == first
    assert summary["skipped_lines"]["eval"]["malformed"] == 1


@pytest.mark.parametrize("skip", [False, True])
def test_hps_train_neither_raises_nor_counts_a_bad_line_past_the_examples_it_reads(tmp_path, capsys, skip):
    # --examples and eval_examples read the first N examples, but the readers parse a
    # block (1 MiB) whole: a bad line past the N-th failed the run naming a line it never
    # trains (in the check that the data holds an example too, which reads one batch),
    # and with skip_malformed was reported as skipped.
    from hps.cli import main
    write_csv(tmp_path / "train.csv", 300, 7)
    write_csv(tmp_path / "eval.csv", 100, 8)
    for name, bad in (("train.csv", 31), ("eval.csv", 41)):  # (line 1 is the header)
        lines = (tmp_path / name).read_text().splitlines()
        lines[bad - 1] = "2,1,s1,t1"  # a label that is not 0 or 1
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    config = malformed_csv_run(tmp_path, f"eval_examples = 39\nskip_malformed = {'true' if skip else 'false'}")
    assert main(["train", "--config", str(config), "--no-progress", "--examples", "29"]) == 0, \
        capsys.readouterr().err
    err = capsys.readouterr().err
    with open(tmp_path / "run" / "train-summary.json") as f:
        summary = json.load(f)
    assert summary["examples"] == 29 and summary["final"]["eval_examples"] == 39
    assert "is not 0 or 1" not in err
    if skip:
        assert summary["skipped_lines"] == {"train": {"malformed": 0, "malformed_examples": []},
                                            "eval": {"malformed": 0, "malformed_examples": []}}


def test_hps_version(capsys):
    from hps.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"hps {hps.__version__}"


def test_hps_train_epochs_with_a_shuffle_buffer(tmp_path):
    write_csv(tmp_path / "train.csv", 500, 7)
    base = {"ps": {"dim": DIM, "path": str(tmp_path / "ps")},
            "hidden": [8], "torch_threads": 1}
    cfg = TrainConfig.from_dict(dict(base, data={"source": str(tmp_path / "train.csv"), "batch_size": 100,
                                                 "schema": SCHEMA, "epochs": 3, "shuffle_buffer": 150}), "run.toml")
    summary = train(cfg, progress=False)
    assert (summary["examples"], summary["batches"]) == (1500, 15)
    with pytest.raises(ValueError, match=r"run.toml: data.epochs must be an int >= 1, got 0"):
        TrainConfig.from_dict(dict(base, data={"epochs": 0}), "run.toml")
    with pytest.raises(ValueError, match=r"run.toml: data.shuffle_buffer must be an int >= 0, got -5"):
        TrainConfig.from_dict(dict(base, data={"shuffle_buffer": -5}), "run.toml")
    # batch_size was checked only by the readers (unnamed: "batch_size must be a positive int"),
    # and the seed not at all: -1 failed at the first shuffle, once the parameter server was written.
    for value in (0, "4096", 2.5, True):
        with pytest.raises(ValueError, match=rf"run.toml: data.batch_size must be an int >= 1, got {value!r}"):
            TrainConfig.from_dict(dict(base, data={"batch_size": value}), "run.toml")
    for value in (-1, 1.5, "x", True):
        with pytest.raises(ValueError, match=rf"run.toml: data.seed must be an int >= 0, got {value!r}"):
            TrainConfig.from_dict(dict(base, data={"source": "x.csv", "epochs": 2, "seed": value}), "run.toml")
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got -1"):
        Epochs(SyntheticCriteo(batch_size=4, examples=8), 2, 4, seed=-1)
    assert TrainConfig.from_dict(dict(base, data={"seed": 2**70}), "run.toml").data.seed == 2**70


@pytest.mark.parametrize("field, value, message", [
    ("vocab_sizes", [0] * 26, r"data.vocab_sizes must be a non-empty list of ints in \[1, 2\*\*31\]"),
    ("vocab_sizes", [-5, 10], r"data.vocab_sizes must be a non-empty list"),
    ("vocab_sizes", [], r"data.vocab_sizes must be a non-empty list"),  # (had taken the defaults)
    ("vocab_sizes", [10, 1.5], r"data.vocab_sizes must be a non-empty list"),
    ("vocab_sizes", [True, 10], r"data.vocab_sizes must be a non-empty list"),
    ("vocab_sizes", [(1 << 31) + 1], r"data.vocab_sizes must be a non-empty list"),
    ("vocab_sizes", 26, r"data.vocab_sizes must be a non-empty list"),
    ("multi_hot", [5], r"data.multi_hot\[0\] must be \[vocabulary size, an int in \[1, 2\*\*31\]; mean bag "
                       r"length, a number in \[0, 1000\]\], got 5$"),  # (a bare TypeError)
    ("multi_hot", [[10, 2], [0, 2]], r"data.multi_hot\[1\] must be"),
    ("multi_hot", [[10, -1]], r"data.multi_hot\[0\] must be"),
    ("multi_hot", [[10, 2, 3]], r"data.multi_hot\[0\] must be"),
    ("multi_hot", [["10", 2]], r"data.multi_hot\[0\] must be"),
    ("multi_hot", [[10, float("nan")]], r"data.multi_hot\[0\] must be"),
    ("multi_hot", "10,2", r"data.multi_hot must be a list of \[vocabulary size, mean bag length\]"),
    ("bag_length", "zipf", r"data.bag_length must be one of 'poisson', 'geometric', 'fixed', got 'zipf'$"),
])
def test_synthetic_data_fields_are_checked_naming_the_file_and_field(tmp_path, field, value, message):
    # SyntheticCriteo refused them once training began, naming neither the file nor the field;
    # vocab_sizes = [] trained on the default vocabularies and a bad bag_length without
    # multi_hot was never read.
    base = {"ps": {"dim": DIM, "path": str(tmp_path / "ps")}, "hidden": [8], "torch_threads": 1}
    with pytest.raises(ValueError, match=rf"^run.toml: {message}"):
        TrainConfig.from_dict(dict(base, data={field: value}), "run.toml")
    assert not (tmp_path / "ps").exists()


def test_synthetic_data_fields_in_range_are_taken(tmp_path):
    base = {"ps": {"dim": DIM, "path": str(tmp_path / "ps")}, "hidden": [8], "torch_threads": 1}
    cfg = TrainConfig.from_dict(dict(base, data={"vocab_sizes": [1, 1 << 31], "multi_hot": [[1, 0], [1 << 31, 1000]],
                                                 "bag_length": "fixed"}), "run.toml")
    assert cfg.data.vocab_sizes == [1, 1 << 31] and cfg.data.bag_length == "fixed"


def test_eval_data_with_other_fields_is_refused_before_training(tmp_path):
    write_csv(tmp_path / "train.csv", 100, 8)
    (tmp_path / "eval.csv").write_text("click,price,site,tags,os\n1,2,s1,t1,ios\n")
    cfg = TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "ps")}, "torch_threads": 1,
                                 "data": {"source": str(tmp_path / "train.csv"), "eval_source":
                                          str(tmp_path / "eval.csv"), "schema": dict(SCHEMA, categorical="rest")}})
    with pytest.raises(ValueError, match=r"eval.csv: the schema gives 1 dense, 2 categorical and 1 multi-hot fields "
                                         r"here, the training data 1, 1 and 1"):
        train(cfg, progress=False)
    assert not (tmp_path / "ps").exists()


def test_eval_data_with_the_columns_in_another_order_is_refused_before_training(tmp_path):
    # The same counts of fields, so the check above let it by: the held-out rows' os
    # values were scored as the training data's site field, and its AUC meant nothing.
    (tmp_path / "train.csv").write_text("click,price,site,os\n" + "1,2,s1,ios\n0,3,s2,and\n" * 10)
    (tmp_path / "eval.csv").write_text("click,price,os,site\n" + "1,2,ios,s1\n0,3,and,s2\n" * 10)
    schema = {"label": "click", "dense": ["price"], "categorical": "rest"}
    cfg = TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "ps")}, "torch_threads": 1,
                                 "data": {"source": str(tmp_path / "train.csv"), "eval_source":
                                          str(tmp_path / "eval.csv"), "schema": schema}})
    with pytest.raises(ValueError) as e:
        train(cfg, progress=False)
    assert str(e.value) == (f"{tmp_path / 'eval.csv'}: the schema gives other fields here than in the training "
                            f"data's {tmp_path / 'train.csv'} (label 'click', dense ['price'], categorical ['os', "
                            f"'site'], multi-hot [] against label 'click', dense ['price'], categorical ['site', "
                            f"'os'], multi-hot [])")
    assert not (tmp_path / "ps").exists()

def test_eval_data_is_held_to_the_fields_of_a_growing_directory_too(tmp_path):
    # The held-out fields were compared with a finite data set's (above), not with a
    # growing directory's, which had no fields(): eval.csv's os values were scored as
    # the site field the online run trained.
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_text("click,price,site,os\n" + "1,2,s1,ios\n0,3,s2,and\n" * 10)
    (tmp_path / "in" / "_DONE").write_text("")
    (tmp_path / "eval.csv").write_text("click,price,os,site\n" + "1,2,ios,s1\n0,3,and,s2\n" * 10)
    schema = {"label": "click", "dense": ["price"], "categorical": "rest"}
    cfg = TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "ps")}, "torch_threads": 1,
                                 "online": True, "data": {"source": str(tmp_path / "in"), "online_poll": 0.05,
                                                          "eval_source": str(tmp_path / "eval.csv"),
                                                          "schema": schema}})
    with pytest.raises(ValueError) as e:
        train(cfg, progress=False)
    assert str(e.value) == (f"{tmp_path / 'eval.csv'}: the schema gives other fields here than in the training "
                            f"data's {tmp_path / 'in' / 'a.csv'} (label 'click', dense ['price'], categorical ['os', "
                            f"'site'], multi-hot [] against label 'click', dense ['price'], categorical ['site', "
                            f"'os'], multi-hot [])")
    assert not (tmp_path / "ps").exists()


def test_hps_train_on_synthetic_multi_hot_fields(tmp_path):
    cfg = TrainConfig.from_dict({
        "ps": {"dim": DIM, "path": str(tmp_path / "ps"), "mem_budget": "16MiB"},
        "data": {"batch_size": 512, "train_examples": 512 * 8, "eval_examples": 1024, "vocab_sizes": [50] * 4,
                 "multi_hot": [[100, 3.0], [20, 1.5]], "bag_length": "geometric"},
        "hidden": [8], "torch_threads": 1, "pooling": "mean"}, "run.toml")
    summary = train(cfg, progress=False)
    assert summary["examples"] == 512 * 8 and summary["final"]["eval_examples"] == 1024
    # Every key the model met has a row: the bags' keys went through the pipeline's working sets.
    from hps.data import SyntheticCriteo
    gen = SyntheticCriteo(seed=0, batch_size=512, examples=512 * 8, vocab_sizes=[50] * 4,
                          multi_hot=[(100, 3.0), (20, 1.5)], bag_length="geometric")
    bag_keys = np.unique(np.concatenate([b.bags[j].keys for b in gen for j in range(2)]))
    assert summary["ps"]["counts"]["initialized"] >= len(bag_keys)


class _OneRank:
    """A stand-in for hps.distributed.Node: what train() asks of a node before the job starts."""

    rank, size = 0, 1

    def __init__(self, widths_of_others=()):
        self.others = list(widths_of_others)

    def allgather(self, channel, value, what, note=None):
        return [value] + (self.others if what == "the data's fields" else [])


def test_distributed_runs_refuse_ranks_with_other_fields(tmp_path):
    # (Multi-hot fields do train under mpiexec: tests/test_distributed.py.)
    write_csv(tmp_path / "train.csv", 100, 9)
    base = {"ps": {"dim": DIM, "path": str(tmp_path / "ps")}, "torch_threads": 1}
    single = dict(SCHEMA, multi_hot={}, skip=["tags"])
    cfg = TrainConfig.from_dict(dict(base, data={"source": str(tmp_path / "train.csv"), "schema": single}))
    with pytest.raises(ValueError, match=r"the ranks' data give different fields .*: rank 0: \(1, 1, 0\) from "
                                         r".*train.csv; rank 1: \(1, 2, 0\) from .*other.csv"):
        train(cfg, progress=False, node=_OneRank([((1, 2, 0), str(tmp_path / "other.csv"))]))
    # A rank of no batch at all has no fields (not the Criteo fields its empty source is taken to have).
    with pytest.raises(ValueError, match=r"different fields .*: rank 0 has no file \(nor batch\) to take them "
                                         r"from; rank 1: \(1, 2, 0\) from .*other.csv"):
        train(cfg, progress=False, node=_OneRank([((1, 2, 0), str(tmp_path / "other.csv"))]), train_batches=[])
    assert not (tmp_path / "ps").exists()


class _ThreadRanks:
    """The ranks of one job as threads of this process: node(rank) stands in for each
    rank's hps.distributed.Node, whose allgather gives every rank's value in rank order.
    A rank that has left train() (raised or returned) never comes to an exchange: the
    ranks waiting in one for it raise _LeftWaiting, where MPI's would wait until the
    watchdog's timeout."""

    def __init__(self, size):
        self.size = size
        self._cond = threading.Condition()
        self._exchanges = []    # each exchange's values, rank by rank (_UNSET: not come yet)
        self._entered = [0] * size  # exchanges each rank has come to
        self._left = []         # ranks that have left train()

    def node(self, rank):
        ranks = self

        class Node:
            size = ranks.size
            machine_ranks = ranks.size

            def allgather(self, channel, value, what, note=None):
                return ranks._allgather(rank, value, what)
        node = Node()
        node.rank = rank
        return node

    def _allgather(self, rank, value, what):
        with self._cond:
            n = self._entered[rank]
            self._entered[rank] += 1
            if n == len(self._exchanges):
                self._exchanges.append([_UNSET] * self.size)
            values = self._exchanges[n]
            values[rank] = value
            self._cond.notify_all()

            def came() -> bool:
                return all(v is not _UNSET for v in values)
            if not self._cond.wait_for(lambda: came() or self._left, timeout=120):
                raise TimeoutError(f"rank {rank}: {what}: the other ranks never came")
            if not came():
                raise _LeftWaiting(f"rank {rank} waits in {what} for rank {self._left[0]}, which has left the job")
            return list(values)

    def train(self, cfg):
        """train(cfg) on every rank (cfg: one config, or a list of one a rank); each
        rank's exception (None: it returned)."""
        cfgs = cfg if isinstance(cfg, list) else [cfg] * self.size
        errors = [None] * self.size

        def run(rank):
            try:
                train(cfgs[rank], progress=False, node=self.node(rank))
            except Exception as e:  # noqa: BLE001 - the test looks at each rank's
                errors[rank] = e
            finally:
                with self._cond:
                    self._left.append(rank)
                    self._cond.notify_all()
        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors


_UNSET = object()


class _LeftWaiting(Exception):
    """A rank of _ThreadRanks waited in an exchange for a rank that had left."""


def test_a_rank_given_another_config_that_its_own_checks_refuse_is_told_the_configs_differ(tmp_path):
    """Rank 1 runs schedule = "herald" with sparse_grads = "bf16" (another config file
    on its host), which train() refuses under mpiexec. It refused it on its own,
    before the ranks compare their configs, and rank 0 waited in that exchange until
    the watchdog's timeout, which said only that a rank had hung. Now the configs
    are compared first: every rank raises, naming the settings that differ."""
    def config(schedule, codec):
        return TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "ps"), "schedule": schedule},
                                      "torch_threads": 1, "distributed": {"sparse_grads": codec}})
    errors = _ThreadRanks(2).train([config("sequential", "none"), config("herald", "bf16")])
    for e in errors:
        assert isinstance(e, ValueError), repr(e)
        assert str(e).startswith("the ranks run different configs (distributed.sparse_grads = 'none' on rank 0, "
                                 "'bf16' on rank 1; ps.schedule = 'sequential' on rank 0, 'herald' on rank 1)"), e
    assert not (tmp_path / "ps").exists()


def test_a_rank_whose_machine_lacks_the_gpus_of_its_model_devices_ends_every_rank_naming_it(tmp_path, monkeypatch):
    """model_devices is a machine's own setting: rank 1 asks for GPUs its machine lacks
    (torch sees none). It refused them on its own, before the ranks' first exchange,
    and rank 0 waited in it until the watchdog's timeout. Now every rank raises at
    once, naming rank 1 and what it lacks."""
    torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (every rank's machine: rank 0 trains on the CPU)
    cfgs = [TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "ps"), "devices": 2},
                                   "torch_threads": 1, "model_devices": devices}) for devices in ("cpu", "cuda")]
    for e in _ThreadRanks(2).train(cfgs):
        assert isinstance(e, ValueError), repr(e)
        assert str(e) == ('rank 1: ValueError: model_devices = "cuda" trains worker g on GPU g: [ps] devices = 2 '
                          'needs 2 GPU(s), and torch sees 0'), e
    assert not (tmp_path / "ps").exists()


def test_ranks_with_other_fields_are_refused_naming_the_file_each_took_them_from(tmp_path):
    # Rank 0 reads a.csv (files[0::2]), rank 1 b.csv: "rest" gives 1 and 2 single-hot
    # fields. The message named no file ("rank 0: (1, 1, 0), rank 1: (1, 2, 0)").
    (tmp_path / "a.csv").write_text("click,price,site\n" + "1,2,s1\n" * 20)
    (tmp_path / "b.csv").write_text("click,price,site,os\n" + "0,3,s2,o2\n" * 20)
    schema = {"label": "click", "dense": ["price"], "categorical": "rest"}
    base = {"ps": {"dim": DIM, "path": str(tmp_path / "ps")}, "torch_threads": 1}
    cfg = TrainConfig.from_dict(dict(base, data={"source": [str(tmp_path / "a.csv"), str(tmp_path / "b.csv")],
                                                 "schema": schema}))
    errors = _ThreadRanks(2).train(cfg)
    for e in errors:
        assert isinstance(e, ValueError)
        assert re.search(r"the ranks' data give different fields \(dense, single-hot, multi-hot\): rank 0: "
                         r"\(1, 1, 0\) from \S*a\.csv; rank 1: \(1, 2, 0\) from \S*b\.csv", str(e)), str(e)
    # More ranks than files: the rank without one is named as such, before any fields are compared.
    cfg = TrainConfig.from_dict(dict(base, data={"source": str(tmp_path / "a.csv"), "schema": schema}))
    for e in _ThreadRanks(2).train(cfg):
        assert isinstance(e, ValueError) and "rank 1: ValueError: rank 1 of 2 gets no file" in str(e), e
    assert not (tmp_path / "ps").exists()


def test_online_ranks_with_other_fields_are_refused_naming_each_ranks_first_file(tmp_path, monkeypatch):
    # Each rank takes its fields from the first file ready at its own polls: rank 1 from
    # b.csv (a.csv not written yet), rank 0 from a.csv.
    from hps.data import GrowingDirectory
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "b.csv").write_text("click,price,site,os\n" + "0,3,s2,o2\n" * 20)
    first_file = GrowingDirectory.first_file
    rank_1_has_its_file = threading.Event()

    def first_file_in_rank_order(self):
        if self.world == 2 and self.rank == 0:
            assert rank_1_has_its_file.wait(60)
        path = first_file(self)
        if self.world == 2 and self.rank == 1 and not rank_1_has_its_file.is_set():
            (tmp_path / "in" / "a.csv").write_text("click,price,site\n" + "1,2,s1\n" * 20)
            (tmp_path / "in" / "_DONE").write_text("")
            rank_1_has_its_file.set()
        return path
    monkeypatch.setattr(GrowingDirectory, "first_file", first_file_in_rank_order)
    cfg = TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "ps")}, "torch_threads": 1,
                                 "online": True, "data": {
                                     "source": str(tmp_path / "in"), "online_poll": 0.05,
                                     "schema": {"label": "click", "dense": ["price"], "categorical": "rest"}}})
    for e in _ThreadRanks(2).train(cfg):
        assert isinstance(e, ValueError)
        assert re.search(r"rank 0: \(1, 1, 0\) from \S*in/a\.csv; rank 1: \(1, 2, 0\) from \S*in/b\.csv",
                         str(e)), str(e)
    assert not (tmp_path / "ps").exists()


def test_hps_train_data_on_libsvm_files(tmp_path, capsys):
    from hps.cli import main
    rng = np.random.default_rng(10)
    lines = []
    for _ in range(600):
        idx = sorted(set(rng.integers(0, 40, 5).tolist()))
        lines.append(f"{'+1' if 7 in idx or rng.random() < 0.1 else '-1'} " + " ".join(f"{i}:1" for i in idx))
    (tmp_path / "train.svm").write_text("\n".join(lines[:500]) + "\n")
    (tmp_path / "eval.svm").write_text("\n".join(lines[500:]) + "\n")
    assert main(["train", "--data", str(tmp_path / "train.svm"), "--eval-data", str(tmp_path / "eval.svm"),
                 "--path", str(tmp_path / "run"), "--batch-size", "50", "--no-progress"]) == 0
    final = json.loads(capsys.readouterr().out)["final"]
    assert final["eval_examples"] == 100
    # Every name open_schema reads as libsvm: .ffm, and compressed files (.svm.bz2, .libfm.zst)
    # had been read as Criteo TSV ("has 1 fields, expected 40").
    text = ("\n".join(lines[:100]) + "\n").encode()
    (tmp_path / "t.ffm").write_bytes(text)
    (tmp_path / "t.svm.bz2").write_bytes(bz2.compress(text))
    with pa.output_stream(tmp_path / "t.LIBFM.zst", compression="zstd") as f:
        f.write(text)
    for name in ("t.ffm", "t.svm.bz2", "t.LIBFM.zst"):
        assert main(["train", "--data", str(tmp_path / name), "--path", str(tmp_path / ("run-" + name)),
                     "--batch-size", "50", "--no-progress"]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["final"]["examples"] == 100
    # A directory of libsvm files is libsvm too (it had gone to the Criteo reader).
    (tmp_path / "svm-dir").mkdir()
    for part in range(2):
        (tmp_path / "svm-dir" / f"part-{part}.svm").write_text("\n".join(lines[part * 50:(part + 1) * 50]) + "\n")
    assert main(["train", "--data", str(tmp_path / "svm-dir"), "--path", str(tmp_path / "run-dir"),
                 "--batch-size", "50", "--no-progress"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["final"]["examples"] == 100


def test_hps_train_on_data_without_an_example_fails_naming_it_and_writes_nothing(tmp_path, capsys):
    # A 0-byte export, a header alone, or every line malformed and skipped: the run
    # trained 0 examples, checkpointed an untrained model and ended with exit 0 (its
    # eval AUC NaN). Refused now before anything is written, the training data or
    # the held-out data named.
    from hps.cli import main
    from hps.data import EmptyFileWarning
    (tmp_path / "empty.svm").write_bytes(b"")
    write_csv(tmp_path / "header.csv", 0, 1)
    (tmp_path / "bad.csv").write_text("click,price,site,tags\n2,1,s1,t1\n3,1,s2,t2\n")
    write_csv(tmp_path / "ok.csv", 50, 2)
    csv = ["--label", "click", "--dense", "price", "--no-progress", "--batch-size", "16"]
    with pytest.warns(EmptyFileWarning, match="empty.svm"):
        assert main(["train", "--data", str(tmp_path / "empty.svm"), "--path", str(tmp_path / "r1"),
                     "--no-progress"]) == 2
    assert f"{tmp_path / 'empty.svm'}: the training data holds no examples (1 file(s)); nothing was written" \
        in capsys.readouterr().err
    with pytest.warns(EmptyFileWarning, match="header.csv"):
        assert main(["train", "--data", str(tmp_path / "header.csv"), "--path", str(tmp_path / "r2"), *csv]) == 2
    assert "header.csv: the training data holds no examples (1 file(s))" in capsys.readouterr().err
    with pytest.warns(EmptyFileWarning, match="header.csv"):
        assert main(["train", "--data", str(tmp_path / "ok.csv"), "--eval-data", str(tmp_path / "header.csv"),
                     "--path", str(tmp_path / "r3"), *csv]) == 2
    assert "header.csv: the held-out data (data.eval_source) holds no examples (1 file(s))" \
        in capsys.readouterr().err
    cfg = TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "r4")}, "torch_threads": 1,
                                 "data": {"source": str(tmp_path / "bad.csv"), "skip_malformed": True,
                                          "schema": SCHEMA}}, "run.toml")
    with pytest.raises(ValueError, match=r"bad.csv: the training data holds no examples \(1 file\(s\), 2 "
                                         r"malformed line\(s\) skipped\)"):
        train(cfg, progress=False)
    assert not any((tmp_path / f"r{i}").exists() for i in range(1, 5))


def test_hps_train_refuses_a_ps_path_inside_a_data_directory(tmp_path):
    # A directory gives its files at every depth: a run whose [ps] path is inside it
    # would read its own checkpoints as data once it resumes (and a growing directory
    # as it writes them). A hidden name (".run", "_run") is left out of the listing.
    (tmp_path / "data" / "day=1").mkdir(parents=True)
    write_csv(tmp_path / "data" / "day=1" / "train.csv", 50, 2)
    write_csv(tmp_path / "other.csv", 50, 3)
    for source, key in ((tmp_path / "data", "source"), (tmp_path / "data" / "day=1", "eval_source")):
        data = {"source": str(tmp_path / "other.csv"), "schema": SCHEMA, key: str(source)}
        cfg = TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "data" / "day=1" / "run")},
                                     "torch_threads": 1, "data": data}, "run.toml")
        with pytest.raises(ValueError, match=rf"\[ps\] path .*data/day=1/run is inside the data directory "
                                             rf"{re.escape(str(source))} \(data.{key}\)"):
            train(cfg, progress=False)
    assert not (tmp_path / "data" / "day=1" / "run").exists()
    cfg = TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "data" / ".run")}, "torch_threads": 1,
                                 "hidden": [8], "data": {"source": str(tmp_path / "data"), "schema": SCHEMA}},
                                "run.toml")
    assert train(cfg, progress=False)["examples"] == 50


def test_hps_train_refuses_outputs_and_held_out_data_a_data_directory_reaches_through_a_link(tmp_path, capsys):
    # A directory's listing follows links: data/more -> elsewhere/ lists elsewhere/run/...
    # too. The checks compared the job's (the report's, the held-out data's) real path
    # with the data directory's alone, so one under a link's target passed: a --resume
    # read the job's checkpoints as data, and held-out examples were trained on.
    from hps.cli import main
    (tmp_path / "data").mkdir()
    (tmp_path / "elsewhere").mkdir()
    write_csv(tmp_path / "data" / "train.csv", 50, 2)
    write_csv(tmp_path / "held.csv", 50, 3)
    (tmp_path / "data" / "more").symlink_to(tmp_path / "elsewhere")
    data = {"source": str(tmp_path / "data"), "schema": SCHEMA}

    def config(path, **more):
        return TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(path)}, "torch_threads": 1, "hidden": [8],
                                      "data": {**data, **more}}, "run.toml")

    job = tmp_path / "elsewhere" / "run"
    with pytest.raises(ValueError, match=rf"^\[ps\] path {re.escape(str(job))} is inside the data directory "
                                         rf"{re.escape(str(tmp_path / 'data'))} \(data.source\), whose files are "
                                         rf"read at every depth"):
        train(config(job), progress=False)
    assert not job.exists()
    report = tmp_path / "elsewhere" / "plots"
    assert main(["train", "--data", str(tmp_path / "data"), "--path", str(tmp_path / "run"), "--report", str(report),
                 "--label", "click", "--dense", "price", "--no-progress"]) == 2
    assert f"--report {report} is inside the data directory {tmp_path / 'data'}" in capsys.readouterr().err
    (tmp_path / "held.csv").rename(tmp_path / "elsewhere" / "held.csv")
    with pytest.raises(ValueError, match=rf"data.eval_source {re.escape(str(tmp_path / 'elsewhere' / 'held.csv'))} "
                                         rf"is inside the training data directory"):
        train(config(tmp_path / "run", eval_source=str(tmp_path / "elsewhere" / "held.csv")), progress=False)
    assert not (tmp_path / "run").exists()
    # A link under a name the listing leaves out is not followed: the job may lie there.
    (tmp_path / "data" / "more").rename(tmp_path / "data" / "_more")
    assert train(config(job, eval_source=str(tmp_path / "elsewhere" / "held.csv")), progress=False)["examples"] == 50
    assert train(config(job), resume=True, progress=False)["examples"] == 50


def test_hps_train_refuses_a_report_directory_inside_a_data_directory(tmp_path, capsys):
    # --report DIR inside the data: the plots written there at the run's end were listed
    # as data by the next run or a --resume (a directory gives its files at every depth),
    # as the [ps] path's checkpoints would be, which is refused; so is the report now,
    # however the path is spelled (through a link, with "..", relative), naming both paths.
    from hps.cli import main
    pytest.importorskip("matplotlib")
    (tmp_path / "data" / "day=1").mkdir(parents=True)
    write_csv(tmp_path / "data" / "day=1" / "train.csv", 50, 2)
    write_csv(tmp_path / "held.csv", 50, 3)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    csv = ["--label", "click", "--dense", "price", "--no-progress", "--batch-size", "25"]
    for report, data, eval_data in [
            (tmp_path / "data" / "plots", tmp_path / "data", tmp_path / "held.csv"),
            (tmp_path / "link" / "day=1" / "plots", tmp_path / "data", tmp_path / "held.csv"),
            (tmp_path / "data" / "x" / ".." / "plots", tmp_path / "link", tmp_path / "held.csv"),
            (tmp_path / "data" / "day=1", tmp_path / "held.csv", tmp_path / "data")]:
        key = "source" if data.name != "held.csv" else "eval_source"
        given = tmp_path / "data" if key == "eval_source" else data
        assert main(["train", "--data", str(data), "--eval-data", str(eval_data), "--path", str(tmp_path / "run"),
                     "--report", str(report), *csv]) == 2, report
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"hps train: --report {report} is inside the data directory {given} (data.{key}), whose files are "
            f"read at every depth: the report's plots would be read as data; write them elsewhere, or under a "
            f"name starting with '.' or '_'")
        assert not (tmp_path / "run").exists() and not (tmp_path / "data" / "plots").exists()
    relative = os.path.relpath(tmp_path / "data" / "plots")
    assert main(["train", "--data", str(tmp_path / "data"), "--path", str(tmp_path / "run"), "--report", relative,
                 *csv]) == 2
    assert f"--report {relative} is inside the data directory {tmp_path / 'data'}" in capsys.readouterr().err
    # Beside the data, or under a name the listing leaves out, it is written.
    for report in (tmp_path / "plots", tmp_path / "data" / "_plots"):
        assert main(["train", "--data", str(tmp_path / "data"), "--path", str(tmp_path / f"run-{report.name}"),
                     "--report", str(report), *csv]) == 0
        assert json.loads(capsys.readouterr().out)["report"] and any(report.iterdir())


def test_hps_train_refuses_held_out_data_inside_the_training_data_directory(tmp_path):
    # The training directory's listing takes data/eval/ too: its examples would be
    # trained on, and the evaluations would score what the model was fitted to.
    (tmp_path / "data" / "eval").mkdir(parents=True)
    write_csv(tmp_path / "data" / "train.csv", 50, 2)
    write_csv(tmp_path / "data" / "eval" / "held.csv", 50, 3)
    for held in (tmp_path / "data" / "eval", tmp_path / "data" / "eval" / "held.csv"):
        cfg = TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "run")}, "torch_threads": 1,
                                     "data": {"source": str(tmp_path / "data"), "schema": SCHEMA,
                                              "eval_source": str(held)}}, "run.toml")
        with pytest.raises(ValueError, match=rf"data.eval_source {re.escape(str(held))} is inside the training "
                                             rf"data directory {re.escape(str(tmp_path / 'data'))}"):
            train(cfg, progress=False)
    assert not (tmp_path / "run").exists()
    (tmp_path / "data" / "eval").rename(tmp_path / "data" / "_eval")  # a name the listing leaves out
    cfg = TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "run")}, "torch_threads": 1,
                                 "hidden": [8], "data": {"source": str(tmp_path / "data"), "schema": SCHEMA,
                                                         "eval_source": str(tmp_path / "data" / "_eval")}},
                                "run.toml")
    assert train(cfg, progress=False)["examples"] == 50


def test_hps_train_refuses_held_out_data_that_is_a_training_file(tmp_path, monkeypatch, capsys):
    # eval_source = "./a.csv" with source = "a.csv" (or a link to it, a hard link, a
    # directory or glob of held-out data that holds a training file) trained and
    # evaluated on the same rows: the reported AUC was a training AUC. Refused before
    # anything is written, naming both fields and the files, compared as the same file.
    from hps.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "train").mkdir(parents=True)
    write_csv(tmp_path / "a.csv", 50, 2)
    write_csv(tmp_path / "b.csv", 50, 3)
    write_csv(tmp_path / "data" / "c.csv", 50, 4)
    write_csv(tmp_path / "data" / "train" / "d.csv", 50, 5)
    (tmp_path / "link.csv").symlink_to(tmp_path / "a.csv")
    os.link(tmp_path / "a.csv", tmp_path / "hard.csv")

    def config(source, held):
        return TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "run")}, "torch_threads": 1,
                                      "hidden": [8], "data": {"source": source, "schema": SCHEMA,
                                                              "eval_source": held}}, "run.toml")

    for source, held, said in [
            ("a.csv", "./a.csv", "data.eval_source ./a.csv is a file of the training data, data.source a.csv"),
            ("a.csv", str(tmp_path / "a.csv"), f"data.eval_source {tmp_path / 'a.csv'} is a file of the training "
                                               f"data, data.source a.csv"),
            ("a.csv", "link.csv", "data.eval_source link.csv is a file of the training data, data.source a.csv"),
            ("a.csv", "hard.csv", "data.eval_source hard.csv is a file of the training data, data.source a.csv"),
            (["b.csv", "a.csv"], f"../{tmp_path.name}/a.csv",
             f"data.eval_source ../{tmp_path.name}/a.csv is a file of the training data, data.source a.csv"),
            ("data/c.csv", "data", "data.eval_source data (data/c.csv) is a file of the training data, "
                                   "data.source data/c.csv"),
            ("data/train", "data", "data.eval_source data (data/train/d.csv) is a file of the training data, "
                                   "data.source data/train (data/train/d.csv)")]:
        with pytest.raises(ValueError, match=rf"^{re.escape(said)}: the evaluations would score examples the "
                                             rf"model is trained on"):
            train(config(source, held), progress=False)
        assert not (tmp_path / "run").exists(), (source, held)
    assert main(["train", "--data", "a.csv", "--eval-data", "./a.csv", "--path", "run", "--label", "click",
                 "--dense", "price", "--no-progress"]) == 2
    assert "hps train: data.eval_source ./a.csv is a file of the training data, data.source a.csv: " \
        in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    # Files of their own: trained and evaluated.
    summary = train(config("a.csv", "b.csv"), progress=False)
    assert summary["examples"] == 50 and summary["final"]["eval_examples"] == 50


def test_hps_train_refuses_outputs_and_held_out_data_a_data_glob_lists(tmp_path, capsys):
    # A glob's listing ("data/**", "data/*/*", "data/*.csv") takes what it matches at
    # the depth its parts reach: the checks looked at directories alone, so a job, a
    # report or held-out data that a glob source lists went by (a --resume read the
    # checkpoints as data; the held-out examples were trained on). They are now refused
    # where the glob, as list_files expands it, lists a file there (through a link too),
    # and not where it lists none (a depth it does not reach, a name its wildcards leave out).
    from hps.cli import main
    (tmp_path / "data" / "day=1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    write_csv(tmp_path / "data" / "day=1" / "train.csv", 50, 2)
    write_csv(tmp_path / "data" / "held.csv", 50, 3)
    (tmp_path / "data" / "more").symlink_to(tmp_path / "elsewhere")
    data = tmp_path / "data"

    def config(source, path, **more):
        return TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(path)}, "torch_threads": 1, "hidden": [8],
                                      "data": {"source": str(source), "schema": SCHEMA, **more}}, "run.toml")

    for source, job in ((data / "**", data / "run"), (data / "*" / "*", data / "run"),
                        (data / "**" / "*.csv", tmp_path / "elsewhere" / "run"), (data / "*", data)):
        with pytest.raises(ValueError, match=rf"^\[ps\] path {re.escape(str(job))} is inside what the data glob "
                                             rf"{re.escape(str(source))} \(data.source\) lists, whose files are "
                                             rf"read: the run's checkpoints would be read as data; put the job "
                                             rf"elsewhere, or under a name starting with '.' or '_'$"):
            train(config(source, job), progress=False)
        assert not (tmp_path / "elsewhere" / "run").exists() and not (data / "run").exists(), source
    report = data / "day=2" / "plots"
    assert main(["train", "--data", str(data / "**" / "*.csv"), "--path", str(tmp_path / "run"), "--report",
                 str(report), "--label", "click", "--dense", "price", "--no-progress"]) == 2
    assert f"--report {report} is inside what the data glob {data / '**' / '*.csv'} (data.source) lists" \
        in capsys.readouterr().err
    write_csv(tmp_path / "elsewhere" / "train.csv", 50, 4)
    for source, held, taken in ((data / "*" / "*.csv", data / "day=1" / "train.csv", ""),
                                (data / "**", data / "day=1", f" ({data / 'day=1' / 'train.csv'})"),
                                (data / "**" / "train.csv", tmp_path / "elsewhere" / "*.csv",
                                 f" ({tmp_path / 'elsewhere' / 'train.csv'})")):
        with pytest.raises(ValueError, match=rf"^data.eval_source {re.escape(str(held))} is among the files of "
                                             rf"the training data glob {re.escape(str(source))} \(data.source\)"
                                             rf"{re.escape(taken)}: the held-out examples would be trained on"):
            train(config(source, tmp_path / "run", eval_source=str(held)), progress=False)
    (tmp_path / "elsewhere" / "train.csv").unlink()
    assert not (tmp_path / "run").exists()
    # Where the glob lists none of it, the job runs, and its resume reads no file of
    # it: a depth "data/*" does not reach, a name "*/train.csv" or "*.csv" does not
    # match, a name its wildcards leave out.
    for source, job in ((data / "**", data / "_run"), (data / "*", data / "run"),
                        (data / "*" / "train.csv", data / "day=1" / "run"), (data / "*.csv", data / "run2")):
        examples = train(config(source, job), progress=False)["examples"]
        assert train(config(source, job), resume=True, progress=False)["examples"] == examples, source


@pytest.mark.parametrize("toml, message", [
    ("ps = 3\n", r"\[ps\]: must be a table, got 3"),
    ("data = 3\n[ps]\ndim = 4\npath = 'p'\n", "data must be a table, got 3"),
    ("distributed = 'x'\n[ps]\ndim = 4\npath = 'p'\n", "distributed must be a table, got 'x'"),
    ("admission = [1]\n[ps]\ndim = 4\npath = 'p'\n", r"admission must be a table, got \[1\]"),
    ("[ps]\ndim = 4\npath = 'p'\nssd = 3\n", r"\[ps\]: ssd must be a table, got 3"),
])
def test_a_table_given_as_a_value_is_named_with_the_file(tmp_path, toml, message):
    # `ps = 3` (or [data], [distributed], [admission], [ps] ssd) in the TOML was an
    # unnamed TypeError ("'int' object is not iterable") naming neither file nor table.
    from hps.cli import main
    config = tmp_path / "run.toml"
    config.write_text(toml)
    with pytest.raises(ValueError, match="^" + re.escape(str(config)) + ": " + message + "$"):
        TrainConfig.from_toml(config)
    assert main(["train", "--config", str(config), "--no-progress"]) == 2


def test_resume_over_shuffled_epochs_continues_to_the_same_result(tmp_path):
    from hps.train import _train_source
    write_csv(tmp_path / "train.csv", 500, 11)
    write_csv(tmp_path / "eval.csv", 300, 12)

    def config(name):
        return TrainConfig.from_dict({
            "ps": {"dim": DIM, "path": str(tmp_path / name), "optimizer": {"kind": "sgd", "lr": 0.1}},
            "data": {"source": str(tmp_path / "train.csv"), "eval_source": str(tmp_path / "eval.csv"),
                     "batch_size": 100, "schema": SCHEMA, "epochs": 2, "shuffle_buffer": 150, "seed": 4},
            "hidden": [8], "torch_threads": 1, "checkpoint_every": 3})

    whole = train(config("whole"), progress=False)
    assert whole["batches"] == 10
    first = list(_train_source(config("half")))[:6]  # a run stopped after its checkpoint at batch 6
    train(config("half"), progress=False, train_batches=first)
    resumed = train(config("half"), resume=True, progress=False)
    assert resumed["batches"] == 10
    assert resumed["final"]["auc"] == whole["final"]["auc"]
    assert resumed["final"]["logloss"] == whole["final"]["logloss"]


@pytest.mark.parametrize("value", ["false", "no", 0, 1])
def test_skip_malformed_that_is_not_a_bool_is_refused(tmp_path, value):
    # TOML's skip_malformed = "false" is a string, which bool() reads as True: the run
    # would leave out the bad lines the user asked to be stopped at.
    with pytest.raises(ValueError, match=r"run.toml: data.skip_malformed must be true or false, got "):
        TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "ps")},
                               "data": {"source": str(tmp_path), "skip_malformed": value}}, "run.toml")


@pytest.mark.parametrize("field, value, message", [
    ("online_poll", "1", r"data.online_poll must be a number > 0 \(seconds\), got '1'"),
    ("online_poll", True, r"data.online_poll must be a number > 0 \(seconds\), got True"),
    ("online_poll", 0, r"data.online_poll must be a number > 0 \(seconds\), got 0"),
    ("online_idle", "5", r"data.online_idle must be a number >= 0 \(seconds\), got '5'"),
    ("online_examples", 2.5, r"data.online_examples must be an int >= 1, got 2.5"),
    ("online_examples", "100", r"data.online_examples must be an int >= 1, got '100'"),
    ("online_marker", 5, r"data.online_marker must be a file name, got 5"),
    ("zipf_a", "1.1", r"data.zipf_a must be a number >= 0, got '1.1'"),
    ("source", 5, r"data.source must be a path, a glob, a directory or a list of them, got 5"),
    ("source", [], r"data.source must be a path, a glob, a directory or a list of them, got \[\]"),
    ("eval_source", [7], r"data.eval_source must be a path, a glob, a directory or a list of them, got \[7\]"),
    ("source", "", r"data.source must be a path, a glob, a directory or a list of them, got ''"),
    ("source", ["a.tsv", ""], r"data.source must be a path, a glob, a directory or a list of them, got \['a.tsv', ''\]"),
    ("eval_source", [""], r"data.eval_source must be a path, a glob, a directory or a list of them, got \[''\]"),
])
def test_data_fields_of_the_wrong_type_are_named(tmp_path, field, value, message):
    # These were taken as given and failed later, in the reader, with a TypeError that named
    # neither the file nor the field ("'>' not supported between instances of 'str' and 'int'"),
    # or were cut short silently (online_examples = 2.5 read 2 examples).
    (tmp_path / "in").mkdir()
    data = {"source": str(tmp_path / "in"), field: value}
    with pytest.raises(ValueError, match="run.toml: " + message):
        TrainConfig.from_dict({"ps": {"dim": DIM, "path": str(tmp_path / "ps")}, "online": True, "data": data},
                              "run.toml")
