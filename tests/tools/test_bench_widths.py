"""tools/bench/bench_widths.py (the side-by-side benchmark against reexpress-sdm): its data and its table, without the
peer (CI never installs it)."""

import numpy as np

import bench_widths as B  # tools/bench/ is on pytest's pythonpath (pyproject.toml)


def test_synthetic_data_has_the_check_s_keys_shapes_and_every_class(tmp_path):
    path = B.synthetic(tmp_path / "d.npz", dim=24, classes=3, n=120, n_eval=40)
    d = np.load(path)
    assert d["train_X"].shape == (120, 24) and d["cal_X"].shape == (120, 24) and d["shift_X"].shape == (40, 24)
    assert d["train_X"].dtype == np.float32 and set(np.unique(d["train_y"])) == {0, 1, 2}
    again = np.load(B.synthetic(tmp_path / "e.npz", dim=24, classes=3, n=120, n_eval=40))
    assert np.array_equal(d["train_X"], again["train_X"])  # seeded


def test_the_table_gives_both_ratios_with_cpu_seconds_rss_and_load():
    run = lambda s, c, p, rss, load: {"train_s": s, "train_cpu_s": c, "predict_s": p, "predict_cpu_s": p,  # noqa: E731
                                      "peak_rss_mb": rss, "load": [load, load]}
    row = {"dim": 384, "classes": 4, "sdm_mlx": run(20.0, 30.0, 0.5, 300, 1.5),
           "reexpress_sdm": run(300.0, 500.0, 5.0, 900, 1.7), "train_ratio": 15.0, "predict_ratio": 10.0}
    text = B.table({"results": [row]})
    assert "| 384 | 4 | 20.0 (30) | 300.0 (500) | 15.00× | 0.50 (0.50) | 5.00 (5.00) | 10.00× | 300 / 900 |" in text
    assert "1.5–1.5; 1.7–1.7" in text
    alone = B.table({"results": [{"dim": 32, "classes": 2, "sdm_mlx": run(2.0, 3.0, 0.1, 100, 1.0)}]})
    assert "| 32 | 2 | 2.0 (3) | — |" in alone
