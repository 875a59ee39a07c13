"""tools/bench/bench_serve_soak.py end to end, briefly: both servers under varied prompt lengths, no errors, a
report."""

import json

import pytest

import bench_serve_soak as S  # tools/bench/ is on pytest's pythonpath (pyproject.toml)


@pytest.mark.slow
@pytest.mark.parametrize("server", ["sdm", "mlx_lm"])
def test_a_short_soak_serves_every_request_and_reports(server, tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert S.main(["--server", server, "--seconds", "4", "--clients", "2", "--support", "200", "--every", "1",
                   "--max-words", "20", "--prompt-cache-bytes", "1048576", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["server"] == server and report["max_words"] == 20
    assert report["requests"] > 0 and report["errors"] == 0, report.get("error_samples")
    assert report["server_exit_code"] in (0, -15)
    assert all(s["rss_mb"] > 0 for s in report["samples"]) and report["peak_rss_mb"] > 0
    assert "second half growth" in capsys.readouterr().out
