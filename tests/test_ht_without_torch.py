"""[hierarchical] is checked, and `hps plan` plans, without torch (an optional
extra: pip install hps[torch]): in a process where importing torch fails."""
from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # `import torch` raises ImportError here, as where it is not installed
    {body}
    assert sys.modules["torch"] is None  # (nothing got around the block)
""")


def _run(body: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED.format(body=textwrap.indent(textwrap.dedent(body), "")),
                           *args], capture_output=True, text=True, timeout=120)


def test_the_blocked_import_fails():
    # The block holds: a module that needs torch cannot be imported in these processes.
    p = _run("import hps.hierarchical.split_mlp")
    assert p.returncode != 0 and "ModuleNotFoundError: import of torch halted" in p.stderr, p.stderr


def test_a_hierarchical_config_is_checked_without_torch():
    # HierarchicalConfig.check imported the planner, which imported the split MLP, which
    # imports torch: a config could not be checked (nor hps train refuse a bad one by
    # its field) where torch is not installed.
    p = _run("""
        from hps.hierarchical.roles import HierarchicalConfig
        HierarchicalConfig.from_dict({"groups": 2, "group_ps": 2, "activations": "int8",
                                      "placement": ["ps:vertical:pair", "ps:horizontal", "ps:whole:1"],
                                      "planner": {"batch_size": 64, "input_width": 100}})
        try:
            HierarchicalConfig.from_dict({"group_ps": 1, "placement": ["ps:whole:1"]}, "ht.toml: [hierarchical]")
        except ValueError as e:
            print(e)
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == ("ht.toml: [hierarchical]: placement[0] = 'ps:whole:1': there is no group PS 1 with "
                                "group_ps = 1 (PSs 0..0)")


def test_hps_plan_plans_without_torch(tmp_path):
    cfg = tmp_path / "ht.toml"
    cfg.write_text('hidden = [1024, 256]\n[ps]\ndim = 16\n[data]\nbatch_size = 2048\n[hierarchical]\ngroup_ps = 2\n'
                   '[hierarchical.planner]\ntrainer_flops = 5e9\n')
    run_plan = """
        from hps.cli import main
        code = main(["plan", "--config", sys.argv[1]])
        sys.stdout.flush()
        assert code == int(sys.argv[2]), code
    """
    p = _run(run_plan, str(cfg), "0")  # the planner's own plan: rules, then refinement
    assert p.returncode == 0, p.stderr
    assert "fc0       429 -> 1024" in p.stdout and "modelled step" in p.stdout, p.stdout
    cfg.write_text('hidden = [32]\n[ps]\ndim = 8\n[hierarchical]\ngroup_ps = 2\nplacement = ["trainer", "ps:vertical"]\n')
    p = _run(run_plan, str(cfg), "2")  # a placement the widths refuse, named as the run names it
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip() == (f"hps plan: {cfg}: [hierarchical] placement ['trainer', 'ps:vertical'] does not fit "
                                f"the MLP: plan: fc1 (32 -> 1, module 2 of the Sequential): its output width of 1 "
                                f"cannot be split over 2 group PSs (one column each at least)"), p.stderr
