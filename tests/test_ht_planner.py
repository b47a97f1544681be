"""hps.hierarchical.planner on hand-made cost cases: the cost model's numbers, the
rules' tags, the placement refinement picks, refusal of a plan that cannot fit,
and `hps plan --config`."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from hps.cli import main  # noqa: E402
from hps.hierarchical.planner import PlanError, PlannerConfig, costs, format_plan, node_costs, plan, tag  # noqa: E402
from hps.hierarchical.split_mlp import FcPlacement as F, SplitPlan  # noqa: E402


def test_costs_by_hand():
    # fc0 4 -> 8 split vertically over 2 PSs, fc1 8 -> 2 on the trainer; B = 10, float32, one optimizer slot.
    cfg = PlannerConfig(batch_size=10, trainer_flops=1e3, ps_flops=2e3, bandwidth=100.0)
    nodes = costs([(4, 8), (8, 2)], SplitPlan([F("ps", "vertical"), F()], 2), cfg)
    t, p0, p1 = nodes
    assert t.flops == 6 * 10 * 8 * 2 and t.memory == 8 * (8 * 2 + 2)
    assert p0.flops == p1.flops == 6 * 10 * 4 * 4
    assert p0.memory == 8 * (4 * 4 + 4)
    # Each PS: x (4 wide) in, its 4 output columns back, their gradient in, dx (4 wide) back; 4 bytes a value.
    assert p0.net_bytes == 10 * (4 + 4 + 4 + 4) * 4 and t.net_bytes == 2 * p0.net_bytes
    assert t.cpu_s == pytest.approx(0.96) and p0.cpu_s == pytest.approx(0.48)
    assert t.net_s == pytest.approx(12.8) and t.time_s == pytest.approx(12.8)
    # Codecs shrink the modelled traffic: int8 forward (1 byte + a 4-byte scale a row), bf16 backward.
    cfg.activations, cfg.gradients = "int8", "bf16"
    _, q0, _ = costs([(4, 8), (8, 2)], SplitPlan([F("ps", "vertical"), F()], 2), cfg)
    assert q0.net_bytes == pytest.approx(10 * ((4 + 4) * 1 + 2 * 4 + (4 + 4) * 2))


def test_node_costs_of_a_given_plan_by_hand():
    # W10's split: fc0 429 -> 512 vertical and fc1 512 -> 256 horizontal on one PS, not
    # paired, fc2 256 -> 1 on the trainer; B = 1024, bf16 both ways, 1e10 FLOP/s.
    cfg = PlannerConfig(batch_size=1024, group_ps=1, trainer_flops=1e10, ps_flops=1e10, bandwidth=1e9,
                        activations="bf16", gradients="bf16")
    shapes = [(429, 512), (512, 256), (256, 1)]
    t, p0 = node_costs(shapes, SplitPlan([F("ps", "vertical"), F("ps", "horizontal"), F()], 1), cfg)
    assert t["node"] == "trainer" and t["layers"] == ["fc2"] and p0["node"] == "ps0"
    assert t["flops"] == 6 * 1024 * 256 and t["cpu_s"] == pytest.approx(6 * 1024 * 256 / 1e10)
    assert p0["flops"] == 6 * 1024 * (429 * 512 + 512 * 256) and p0["cpu_s"] == pytest.approx(p0["flops"] / 1e10)
    # Forward 429 out, 512 back, 512 out, 256 back; backward the same widths the other way; 2 bytes a value.
    assert p0["net_bytes"] == t["net_bytes"] == 1024 * 2 * 2 * (429 + 512 + 512 + 256)
    assert p0["net_s"] == pytest.approx(p0["net_bytes"] / 1e9) and p0["time_s"] == max(p0["cpu_s"], p0["net_s"])
    assert p0["memory"] == 8 * (429 * 512 + 512 + 512 * 256 + 256)
    # The same numbers as costs(), which hps plan prints.
    assert [n.cpu_s for n in costs(shapes, SplitPlan([F("ps", "vertical"), F("ps", "horizontal"), F()], 1), cfg)] \
        == [t["cpu_s"], p0["cpu_s"]]


def test_node_costs_refuses_a_plan_the_split_mlp_would():
    cfg = PlannerConfig(group_ps=1)
    with pytest.raises(ValueError, match="places 2 Linear layers, the shapes have 3"):
        node_costs([(4, 8), (8, 2), (2, 1)], SplitPlan([F(), F()], 1), cfg)
    with pytest.raises(ValueError, match=r"fc1 \(8 -> 2, module 2 of the Sequential\) is paired but is the last Linear"):
        node_costs([(4, 8), (8, 2)], SplitPlan([F(), F("ps", "vertical", pair=True)], 1), cfg)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        node_costs([(4, 8)], SplitPlan([F()], 1), PlannerConfig(group_ps=1, bandwidth=0))


def test_pair_traffic_skips_the_intermediate():
    cfg = PlannerConfig(batch_size=1)
    shapes = [(8, 64), (64, 4)]
    pair = costs(shapes, SplitPlan([F("ps", "vertical", pair=True), F("ps", "horizontal")], 2), cfg)
    apart = costs(shapes, SplitPlan([F("ps", "vertical"), F("ps", "horizontal")], 2), cfg)
    # Pair: x (8) in and a 4-wide partial out, then back again; apart the 64-wide intermediate crosses twice.
    assert pair[1].net_bytes == 4 * (8 + 4 + 4 + 8)
    assert apart[1].net_bytes == 4 * ((8 + 32 + 32 + 8) + (32 + 4 + 4 + 32))
    assert pair[1].flops == apart[1].flops


def test_rules_tag_big_layers_and_pairs():
    cfg = PlannerConfig(big_fc_bytes=4 * 1000)
    # 800 B, 32 kB, 80 kB, 1.2 kB, 14.4 kB and 2.4 kB of weights.
    t = tag([(10, 20), (20, 400), (400, 50), (50, 6), (6, 600), (600, 1)], cfg)
    assert t.fcs == [F(), F("ps", "vertical", pair=True), F("ps", "horizontal"), F(), F("ps", "vertical"), F()]
    # Two big layers that break the pair rule (the first narrows) stay apart.
    t = tag([(400, 50), (50, 600)], cfg)
    assert t.fcs == [F("ps", "horizontal"), F("ps", "vertical")]


def test_slow_network_keeps_everything_on_the_trainer():
    # The rules send every layer to the PSs (big_fc_bytes = 0), but the link is so slow
    # that the refinement brings them all back.
    cfg = PlannerConfig(batch_size=256, big_fc_bytes=0, bandwidth=1e3)
    r = plan([(32, 256), (256, 16), (16, 1)], cfg)
    assert r.plan.fcs == [F(), F(), F()]
    assert r.moves >= 1 and r.bottleneck == "trainer"
    assert all(n.net_bytes == 0 for n in r.nodes)


def test_slow_trainer_moves_a_co_partitioned_pair_to_the_ps():
    # The rules keep all on the trainer (no layer is "big"); the trainer's CPU is the
    # bottleneck and the network fast: the best single move is the pair, which sends no
    # wide intermediate.
    cfg = PlannerConfig(batch_size=1024, big_fc_bytes=1e12, trainer_flops=1e9, ps_flops=1e11, bandwidth=1e10)
    r = plan([(64, 2048), (2048, 64), (64, 1)], cfg)
    assert r.plan.fcs[:2] == [F("ps", "vertical", pair=True), F("ps", "horizontal")]
    assert r.plan.fcs[2] == F()
    before = max(n.time_s for n in costs(r.shapes, SplitPlan([F(), F(), F()], 2), cfg))
    assert r.step_s < before / 10


def test_plans_made_one_after_another_leave_no_state_behind():
    # _valid kept every plan it checked, of every model, in a module-level dict for the
    # life of the process: a process that plans many models (a sweep) grew without bound.
    import hps.hierarchical.planner as planner

    def held():
        return {name: len(v) for name, v in vars(planner).items()
                if isinstance(v, (dict, list, set)) and not name.startswith("__")}
    cfg = PlannerConfig(batch_size=1024, big_fc_bytes=1e12, trainer_flops=1e9, ps_flops=1e11, bandwidth=1e10)
    plan([(64, 2048), (2048, 64), (64, 1)], cfg)  # (any module state made on first use)
    before = held()
    for width in range(8, 16):
        r = plan([(64, width * 256), (width * 256, 64), (64, 1)], cfg)
        assert r.plan.fcs[:2] == [F("ps", "vertical", pair=True), F("ps", "horizontal")]  # each refined
    assert held() == before


def test_no_time_for_refinement_keeps_the_rules_plan():
    cfg = PlannerConfig(batch_size=1024, big_fc_bytes=1e12, trainer_flops=1e9, time_limit=0)
    r = plan([(64, 2048), (2048, 64), (64, 1)], cfg)
    assert r.moves == 0 and r.plan.fcs == [F(), F(), F()]


def test_memory_forces_a_layer_off_the_trainer():
    # The fastest plan keeps the 4 MB layer on the trainer, but the trainer has 1 MB.
    cfg = PlannerConfig(batch_size=64, big_fc_bytes=1e12, bandwidth=1e6, trainer_memory=1e6, ps_memory=1e9)
    r = plan([(512, 1024), (1024, 1)], cfg)
    assert r.plan.fcs[0].where == "ps"
    assert r.nodes[0].memory <= 1e6


def test_a_plan_that_cannot_fit_is_refused():
    cfg = PlannerConfig(trainer_memory=1e6, ps_memory=1e6)
    with pytest.raises(PlanError, match=r"no placement fits: (the trainer|group PS \d) needs [\d.,]+ MB for the "
                                        r"weights and optimizer state of .* but has 1.0 MB"):
        plan([(1024, 1024), (1024, 1)], cfg)


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="group_ps must be an int >= 1, got 0"):
        plan([(2, 2)], PlannerConfig(group_ps=0))
    with pytest.raises(ValueError, match="activations: unknown codec 'fp8'"):
        plan([(2, 2)], PlannerConfig(activations="fp8"))
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        plan([(2, 2)], PlannerConfig(bandwidth=0))


def test_format_lists_layers_and_nodes():
    cfg = PlannerConfig(batch_size=1024, big_fc_bytes=1e12, trainer_flops=1e9, ps_flops=1e11, bandwidth=1e10)
    text = format_plan(plan([(64, 2048), (2048, 64), (64, 1)], cfg))
    assert "fc0        64 -> 2048    group PS 0..1    vertical, co-partitioned with fc1" in text
    assert "fc2        64 -> 1       trainer          -" in text
    assert [line.split()[0] for line in text.splitlines() if line.startswith(("trainer ", "ps"))] == \
        ["trainer", "ps0", "ps1"]


def test_hps_plan_command(tmp_path, capsys):
    cfg = tmp_path / "ht.toml"
    cfg.write_text('hidden = [1024, 256]\n[ps]\ndim = 16\npath = "/tmp/x"\n[data]\nbatch_size = 2048\n'
                   '[hierarchical]\ngroup_ps = 2\nactivations = "int8"\ngradients = "bf16"\n'
                   '[hierarchical.planner]\ntrainer_flops = 5e9\n')
    assert main(["plan", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "fc0       429 -> 1024" in out and "fc2       256 -> 1" in out
    assert "ps1 " in out and "modelled step" in out
    cfg.write_text('hidden = [1024]\n[ps]\ndim = 16\n[hierarchical]\ngroup_ps = 2\n'
                   '[hierarchical.planner]\nps_memory = 1e3\ntrainer_memory = 1e3\n')
    assert main(["plan", "--config", str(cfg)]) == 1
    assert "hps plan: PlanError: no placement fits" in capsys.readouterr().err
    cfg.write_text('hidden = [8]\n[ps]\ndim = 4\n[hierarchical]\ngroup = 2\n')
    assert main(["plan", "--config", str(cfg)]) == 2
    assert "unknown field(s) hierarchical.group" in capsys.readouterr().err
    cfg.write_text('hidden = [8]\n[hierarchical.planner]\ninput_width = 30\nbandwidth = -1\n')
    assert main(["plan", "--config", str(cfg)]) == 2
    assert "[hierarchical.planner]: bandwidth must be > 0, got -1" in capsys.readouterr().err


def test_hps_plan_shows_the_placement_the_run_uses(capsys):
    """examples/hierarchical.toml fixes its placement (fc0 vertical, fc1 horizontal on the
    group PS, fc2 on the trainer), which the run uses; hps plan printed the planner's own
    choice instead (fc1 on the trainer), so it said the layers run where they do not."""
    from pathlib import Path
    example = Path(__file__).resolve().parents[1] / "examples" / "hierarchical.toml"
    assert main(["plan", "--config", str(example)]) == 0
    out = capsys.readouterr().out
    assert "fc0       429 -> 512     group PS 0       vertical" in out
    assert "fc1       512 -> 256     group PS 0       horizontal" in out
    assert "fc2       256 -> 1       trainer          -" in out
    assert "the config's placement, not the planner's" in out


def test_hps_plan_without_group_ps_keeps_every_layer_on_the_trainer(tmp_path, capsys):
    """group_ps = 0 (the default, as in a config with no [hierarchical]) runs the whole MLP
    on the trainers; hps plan placed layers on a 'group PS 0' the run does not have."""
    cfg = tmp_path / "plain.toml"
    cfg.write_text('hidden = [32]\n[ps]\ndim = 8\n[data]\nbatch_size = 1024\n')
    assert main(["plan", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "group PS" not in out and "\nps0" not in out, out
    assert "fc1        32 -> 1       trainer          -" in out and "every layer on the trainer" in out


def test_hps_plan_names_a_placement_of_the_wrong_length(tmp_path, capsys):
    cfg = tmp_path / "ht.toml"
    cfg.write_text('hidden = [32]\n[ps]\ndim = 8\n[hierarchical]\ngroup_ps = 1\nplacement = ["trainer"]\n')
    assert main(["plan", "--config", str(cfg)]) == 2
    assert capsys.readouterr().err.strip() == f"hps plan: {cfg}: [hierarchical] placement names 1 Linear layers, " \
                                               f"the MLP has 2"


@pytest.mark.parametrize("toml,message", [
    ('hidden = 32\n[ps]\ndim = 4\n', "hidden must be a list of layer widths, ints >= 1 ([] for none), got 32"),
    ('hidden = [32, "x"]\n[ps]\ndim = 4\n', "hidden must be a list of layer widths, ints >= 1 ([] for none), "
                                            "got [32, 'x']"),
    ('hidden = [32.7]\n[ps]\ndim = 4\n', "hidden must be a list of layer widths, ints >= 1 ([] for none), got [32.7]"),
    ('hidden = [32]\n[ps]\ndim = 0\n', "[ps] dim must be an int >= 1, got 0"),
    ('hidden = [32]\n[ps]\ndim = "4"\n', "[ps] dim must be an int >= 1, got '4'"),
    ('hidden = [32]\n[ps]\ndim = 4\n[data]\nbatch_size = true\n', "[data] batch_size must be an int >= 1, got True"),
    # not tables: an unnamed TypeError ("argument of type 'int' is not iterable")
    ('hidden = [32]\nps = 3\n', "ps must be a table, got 3"),
    ('hidden = [32]\nps = "dim"\n', "ps must be a table, got 'dim'"),
    ('hidden = [32]\ndata = 3\n[ps]\ndim = 4\n', "data must be a table, got 3"),
])
def test_hps_plan_names_a_bad_model_or_batch_field(tmp_path, capsys, toml, message):
    # hps plan reads the training config's hidden, [ps] dim and [data] batch_size with
    # int(): `hidden = 32` was a TypeError traceback, a string an unnamed "invalid
    # literal for int()", and 32.7, "4" or true were modelled as 32, 4 or a batch of 1.
    cfg = tmp_path / "ht.toml"
    cfg.write_text(toml)
    assert main(["plan", "--config", str(cfg)]) == 2
    assert capsys.readouterr().err.strip() == f"hps plan: {cfg}: {message}"


def test_hps_plan_names_a_placement_the_widths_do_not_allow(tmp_path, capsys):
    cfg = tmp_path / "ht.toml"
    cfg.write_text('hidden = [32]\n[ps]\ndim = 8\n[hierarchical]\ngroup_ps = 2\nplacement = ["trainer", '
                   '"ps:vertical"]\n')
    assert main(["plan", "--config", str(cfg)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"hps plan: {cfg}: [hierarchical] placement ['trainer', 'ps:vertical'] does not fit the MLP: plan: fc1 "
        f"(32 -> 1, module 2 of the Sequential): its output width of 1 cannot be split over 2 group PSs (one column "
        f"each at least)")


def test_a_refinement_cut_short_by_its_time_limit_says_so_rather_than_that_nothing_fits():
    # The rules keep both layers on the trainer, which has 10 kB; one move (the first
    # layer whole on a PS) fits. With no time to refine, the planner said "no placement
    # fits ... add group PSs or memory": the limit that stopped it went unnamed.
    shapes = [(100, 100), (100, 1)]
    fits = plan(shapes, PlannerConfig(group_ps=2, trainer_memory=1e4, time_limit=60))
    assert fits.plan.fcs[0].where == "ps" and fits.nodes[0].memory <= 1e4
    with pytest.raises(PlanError, match=r"^no placement found that fits within \[hierarchical.planner\] time_limit = "
                                        r"0 s of refinement \(0 moves\): the trainer needs 0.1 MB .* but has 0.0 MB "
                                        r"\(trainer_memory\); raise time_limit"):
        plan(shapes, PlannerConfig(group_ps=2, trainer_memory=1e4, time_limit=0))


def test_hps_plan_names_a_layer_as_the_run_does_and_as_its_table_does(tmp_path, capsys):
    # hps plan checked a placement against a Sequential of the Linears alone, the run
    # against the model's MLP (a ReLU after each hidden Linear): the same refusal named
    # the last Linear "layer 2" in hps plan and "layer 4" in the run, and neither is
    # "fc2", its row in hps plan's table (placement[2] in the config).
    import hps.hierarchical.roles as roles
    from hps.hierarchical.roles import HierarchicalConfig
    from hps.torch import mlp
    placement = ["trainer", "trainer", "ps:vertical"]
    cfg = tmp_path / "ht.toml"
    cfg.write_text(f'hidden = [32, 16]\n[ps]\ndim = 8\n[hierarchical]\ngroup_ps = 2\nplacement = {placement!r}\n'
                   .replace("'", '"'))
    assert main(["plan", "--config", str(cfg)]) == 2
    planned = capsys.readouterr().err.strip()
    with pytest.raises(ValueError) as ran:
        roles._plan_for(mlp(26 * 8 + 13, [32, 16]), HierarchicalConfig(group_ps=2, placement=placement))
    assert planned == f"hps plan: {cfg}: {ran.value}"
    assert "plan: fc2 (16 -> 1, module 4 of the Sequential): its output width of 1 cannot be split over 2 group " \
           "PSs" in planned, planned
    cfg.write_text(cfg.read_text().replace('"ps:vertical"]', '"ps:whole:1"]'))
    assert main(["plan", "--config", str(cfg)]) == 0
    assert "\nfc2        16 -> 1       group PS 1       whole\n" in capsys.readouterr().out
