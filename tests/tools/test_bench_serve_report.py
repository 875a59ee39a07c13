"""tools/bench/bench_serve.py's report: ratios paired within each repeat, and the printed table."""

import bench_serve as B  # tools/bench/ is on pytest's pythonpath (pyproject.toml)


def _run(clients, rps, p50, p95):
    return {"clients": clients, "requests_per_s": rps, "latency_p50_s": p50, "latency_p95_s": p95,
            "tokens_per_s": rps * 20, "latency_mean_s": p50, "errors": 0, "server_generation_s": 0.01,
            "server_verification_s": 0.002}


def test_ratios_are_paired_within_each_repeat():
    ours = [_run(4, 50, 0.08, 0.12), _run(16, 90, 0.2, 0.3), _run(4, 40, 0.1, 0.2), _run(16, 60, 0.3, 0.4)]
    theirs = [_run(4, 25, 0.08, 0.10), _run(16, 60, 0.25, 0.3), _run(4, 40, 0.05, 0.1), _run(16, 120, 0.15, 0.2)]
    r = B.paired_ratios(ours, theirs)
    assert r["4"]["requests_per_s"]["each"] == [2.0, 1.0] and r["4"]["requests_per_s"]["median"] == 1.5
    assert r["16"]["requests_per_s"]["each"] == [1.5, 0.5] and r["16"]["latency_p95_s"]["each"] == [1.0, 2.0]
    assert r["4"]["latency_p50_s"]["each"] == [1.0, 2.0]


def test_the_table_prints_the_paired_ratios(capsys):
    ours, theirs = [_run(4, 50, 0.08, 0.12)], [_run(4, 25, 0.08, 0.10)]
    report = {"size": "tiny", "tokens": 32, "support": 10, "blas": "x", "mlx_lm_lengths": "matched to ours per prompt",
              "sdm": {"load": ours}, "mlx_lm": {"load": theirs}, "paired_ratios": B.paired_ratios(ours, theirs),
              "ttft_s": {"mlx_lm": 0.01, "sdm_return": 0.01, "sdm_abstain": 0.05},
              "peak_rss_mb": {"mlx_lm": 100, "sdm": 150}, "load_average_before": [1.0], "load_average_after": [1.0]}
    B.print_table(report)
    out = capsys.readouterr().out
    assert "paired ratios sdm/mlx_lm at 4 client(s), median of 1 repeats: requests_per_s 2.00 (2.00)" in out
    assert "mlx_lm answer lengths: matched to ours per prompt" in out


def test_soak_quarter_medians_are_robust_to_single_readings():
    import bench_serve_soak as S

    samples = [{"t_s": t, "rss_mb": 100.0 + (50 if t == 170 else 0)} for t in range(0, 301, 10)]
    assert S.quarter_medians(samples, 300) == [100.0, 100.0, 100.0, 100.0]  # one 150 MiB reading moves no median
    samples = [{"t_s": t, "rss_mb": 100.0 + t / 10} for t in range(0, 301, 10)]
    q = S.quarter_medians(samples, 300)
    assert q[0] < q[1] < q[2] < q[3] and q[3] == 126.5  # 230..300 s: the last quarter includes the final reading
    assert S.quarter_medians([{"t_s": 200, "rss_mb": 1.0}], 300) == [None, None, 1.0, None]


def test_soak_quarter_ranges_keep_both_modes_of_a_swinging_server():
    import bench_serve_soak as S

    # a trimmed heap: readings alternate between what is kept (100) and the working peak (300)
    samples = [{"t_s": t, "rss_mb": 100.0 if (t // 10) % 2 else 300.0} for t in range(0, 301, 10)]
    assert S.quarter_ranges(samples, 300) == [[100.0, 300.0]] * 4
    # a reading that failed (None) is left out
    assert S.quarter_ranges([{"t_s": 0, "rss_mb": None}, {"t_s": 80, "rss_mb": 5.0}], 300) == [None, [5.0, 5.0], None, None]
