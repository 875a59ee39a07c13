"""tools/bench/bench_host_adam.py: the pass before e8af06a that it measures against still trains as the step's own
pass does, and a run reports every mode with its machine shares and the ratios."""

import json

import numpy as np

import bench_host_adam as B  # tools/bench/ is on pytest's pythonpath (pyproject.toml)
from bench_network import _head_only_model
from sdm_mlx.network.heads import SDMHeads
from sdm_mlx.network.step import make_optimizer


def test_the_pass_before_moves_w_pos_as_the_threaded_pass_does():
    model = _head_only_model(616, 64, None)
    rng = np.random.default_rng(3)
    batch = ((rng.standard_normal((7, 64)) * 3).astype(np.float32), rng.integers(616, 1232, 7),
             rng.uniform(1, 30, 7).astype(np.float32), rng.uniform(0.3, 1, 7).astype(np.float32))
    after = {}
    for mode in ("before", "threads2"):
        heads = SDMHeads(model)
        step = B.make_step(mode, heads, make_optimizer(1e-3))
        step.block_rows = 32
        step.begin()
        for _ in range(2):
            step(*batch, 0.05)
        after[mode] = step.w_pos.copy()
        step.end()
    moved = np.abs(after["threads2"] - np.asarray(model.lm_head.weight)).max()
    assert moved > 1e-5
    np.testing.assert_allclose(after["before"], after["threads2"], rtol=0, atol=1e-3 * moved)


def test_a_run_reports_each_mode_with_the_cpu_shares_and_the_ratios(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert B.main(["--size", "tiny", "--steps", "1", "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["before", "threads1", "threads2"] * 2
    for r in report["rows"]:
        assert r["step_s"] > 0 and r["pass_s"] > 0 and r["load_average"] >= 0 and r["rss_mb"] > 0
        assert abs(r["cpu_user"] + r["cpu_system"] + r["cpu_idle"] + r["cpu_steal"] - 1) < 1e-6 or r["cpu_user"] == 0
    assert report["speedup_over_before"]["before"] == {"step_s": 1.0, "pass_s": 1.0}
    assert set(report["median"]) == {"before", "threads1", "threads2"}
    assert "x before (pass)" in capsys.readouterr().out
