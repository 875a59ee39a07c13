"""The sharded exact index under mlx.distributed (docs/distributed.md): two local ranks of the ring backend give
the single-process results of the same machine, computed in the same run, bit for bit (random data with ties and self-exclusion, the embedded factcheck
fit + estimate, the CLI), and a rank that dies or hangs ends the other with a clear error in bounded time.

Each launch starts two Python processes (~2 s of imports each); the ranks use free ports, never the
launcher's default 32323, so parallel runs do not collide.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sdm_mlx.runtime import distributed as dist
from sdm_mlx.index import ExactIndex, make_index

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = TESTS / "helpers" / "distributed_script.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"

sys.path.insert(0, str(TESTS / "helpers"))
from distributed_script import POOL_EVERY, index_results, random_case, tiny_case  # noqa: E402
from ports import free_port_pair  # noqa: E402

needs_launch = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed next to the Python")




def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}


def launch(command: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """``mlx.launch -n 2 --backend ring`` on localhost (the launcher itself always exits 0)."""
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(free_port_pair()),
           "--python", sys.executable, "--", *command]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=TESTS.parent)


def start_by_hand(mode: str, out: Path, extra_env: dict | None = None) -> list[subprocess.Popen]:
    """Two ranks started as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE), but with no launcher to stop them."""
    port = free_port_pair()
    hostfile = out / "hosts.json"
    out.mkdir(parents=True, exist_ok=True)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = []
    for rank in range(2):
        e = {**env(), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), **(extra_env or {})}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), mode, str(out)], env=e, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:  # both ranks answered one sharded query
        line = p.stdout.readline()
        assert line.startswith("ready"), (line, p.stderr.read() if p.poll() is not None else "")
    return procs


# -- single process ------------------------------------------------------------------------------
def test_shard_bounds_tile_the_rows_contiguously_and_balanced():
    for n in (1, 2, 7, 100, 1001):
        for size in (1, 2, 3, 8):
            bounds = [dist.shard_bounds(n, r, size) for r in range(size)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(bounds[r][1] == bounds[r + 1][0] for r in range(size - 1))
            lengths = [b - a for a, b in bounds]
            assert max(lengths) - min(lengths) <= 1
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        dist.shard_bounds(10, 2, 2)


def test_single_process_helpers_are_the_identity_and_the_index_stays_local():
    assert dist.size() == 1 and dist.rank() == 0 and dist.is_primary() and not dist.is_distributed()
    a = np.array([[1.5, -np.inf], [np.nan, 2.0]])
    assert np.array_equal(dist.all_gather_rows(a)[0], a, equal_nan=True)
    assert dist.all_sum_int(np.array([3, 4])).tolist() == [3, 4]
    assert dist.all_sum(np.array([1.5], np.float32)).dtype == np.float32 and dist.all_max(np.array([2])) == 2
    assert np.array_equal(dist.gather_rows(a), a, equal_nan=True)
    dist.check_same("anything", a)
    support = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32)
    assert type(make_index(support, "exact", shard=True)) is ExactIndex


def test_smallest_pairs_orders_by_distance_then_index_with_padding_last():
    d = np.array([[2.0, 1.0, 1.0, np.inf, np.inf, 1.0 + 2**-52]])
    i = np.array([[0, 9, 4, -1, 3, 1]])
    sd, si = dist.smallest_pairs(d, i, 6)
    assert si.tolist() == [[4, 9, 1, 0, 3, -1]]
    assert sd[0, :3].tolist() == [1.0, 1.0, 1.0 + 2**-52]
    md, mi = dist.merge_min_pairs(np.array([1.0, np.inf]), np.array([7, -1]))
    assert md.tolist() == [1.0, np.inf] and mi.tolist() == [7, -1]


def test_exact_index_exclude_minus_one_excludes_nothing():
    """Regression: exclude = −1 ("nothing") used to mask the LAST support row in similarity_and_neighbours."""
    support, good, queries, y_hat, _ = random_case()
    index = ExactIndex(support)
    k = support.shape[0] + 10  # no cap: q with exclude −1 (k − 1) must equal q without exclusion
    q_none, d0_none = index.similarity(queries, y_hat, good, k)
    q_m1, d0_m1 = index.similarity(queries, y_hat, good, k, exclude=-np.ones(queries.shape[0], dtype=np.int64))
    assert np.array_equal(q_none, q_m1) and np.array_equal(d0_none, d0_m1)


# -- two ranks ---------------------------------------------------------------------------------
@needs_launch
def test_sharded_index_equals_the_single_process_index(tmp_path):
    run = launch([str(SCRIPT), "index", str(tmp_path)])
    assert (tmp_path / "rank0.npz").exists() and (tmp_path / "rank1.npz").exists(), run.stdout + run.stderr
    case = random_case()
    ref = index_results(ExactIndex(case[0]), case)
    assert ref["q_ex"].max() > 5 and (ref["ni_ex"] == -1).sum() == 0 and (ref["si_all"] == -1).any()
    tiny = index_results(ExactIndex(tiny_case()[0]), tiny_case())
    assert tiny["q"].tolist() == [3, 0, 2, 0, 1] and tiny["q_ex"].tolist() == [2, 0, 2, 0, 0]  # by hand
    for rank in (0, 1):
        got = np.load(tmp_path / f"rank{rank}.npz")
        for key, want in ref.items():
            for name in (key, f"shard_{key}"):  # from_full, and the (shard, offset, total) constructor
                assert got[name].dtype == want.dtype and np.array_equal(got[name], want), (rank, name)
        for key, want in tiny.items():
            assert got[f"tiny_{key}"].dtype == want.dtype and np.array_equal(got[f"tiny_{key}"], want), (rank, key)


@pytest.mark.slow  # the embedded data's fit under mlx.launch; the default tier: random data with ties, and the CLI
@needs_launch
def test_fit_and_estimate_on_factcheck_equal_the_single_process_run(tmp_path):
    """Alg. 1 (q, d refreshed per epoch on the sharded index), calibration and estimate under 2 ranks give the
    single-process results bit for bit.  The reference is computed in this run on this machine (float32 BLAS
    rounds differently per CPU, so a file written elsewhere is no reference: see behaviour_fixture.py)."""
    from behaviour_fixture import ROWS, canonical, fit_fixture_estimator, fixture_results
    from sdm_mlx.storage.datasets import factcheck_splits
    from sdm_mlx.estimator import SDMEstimator

    run = launch([str(SCRIPT), "fixture", str(tmp_path)])
    records = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    assert all(p.exists() for p in records), run.stdout + run.stderr
    r0, r1 = (json.loads(p.read_text()) for p in records)
    assert r0["index"] == "ShardedExactIndex"
    assert r0["adaptor"] == r1["adaptor"]  # the replicated adaptor training is bit-identical across ranks
    assert r0["history"] == r1["history"] and r0["round_summaries"] == r1["round_summaries"]
    single = fit_fixture_estimator(POOL_EVERY)
    expected = canonical(fixture_results(single))
    assert r0["history"] == json.loads(json.dumps(single.history_))
    assert r0["results"] == expected and r1["results"] == expected
    assert any(r["admitted"] for r in json.loads(expected)["heldout"])  # the compared estimates admit rows
    # rank 0 alone wrote the model; a single process loads it and answers as the distributed run
    est = SDMEstimator.load(tmp_path / "model")
    assert type(est.index_) is ExactIndex
    _, heldout, _ = factcheck_splits()
    rows = est.estimate(heldout.X[:ROWS], ids=heldout.ids[:ROWS]).to_dicts()
    assert json.dumps(rows, sort_keys=True) == json.dumps(json.loads(expected)["heldout"], sort_keys=True)


def _write_jsonl(path: Path, ds, rows: slice) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(*rows.indices(ds.X.shape[0])):
            f.write(json.dumps({"id": ds.ids[i], "label": int(ds.y[i]), "embedding": ds.X[i].tolist()}) + "\n")


@needs_launch
def test_cli_train_under_launch_then_single_process_predict_equals_distributed_predict(tmp_path):
    from sdm_mlx.storage.datasets import factcheck_splits

    pool, heldout, _ = factcheck_splits()
    _write_jsonl(tmp_path / "train.jsonl", pool, slice(0, 2400))
    _write_jsonl(tmp_path / "test.jsonl", heldout, slice(0, 150))
    cli = ["-m", "sdm_mlx"]
    train = launch(cli + ["train", "--train", str(tmp_path / "train.jsonl"), "--output", str(tmp_path / "model"),
                          "--iterations", "2", "--epochs", "2", "--exemplar-dim", "32", "--learning-rate", "1e-3",
                          "--rescaler-max-epochs", "30", "--shard-index"])
    assert (tmp_path / "model").is_dir(), train.stdout + train.stderr
    assert train.stdout.count("trained in") == 1  # rank 0 alone reports
    assert not list(tmp_path.glob("model.partial*"))  # no checkpoint under mlx.launch
    predict = launch(cli + ["predict", "--model", str(tmp_path / "model"), "--input", str(tmp_path / "test.jsonl"),
                            "--output", str(tmp_path / "dist.jsonl")])
    assert (tmp_path / "dist.jsonl").exists(), predict.stdout + predict.stderr
    assert predict.stderr.count("rows,") == 1
    single = subprocess.run([sys.executable, "-m", "sdm_mlx", "predict", "--model", str(tmp_path / "model"),
                             "--input", str(tmp_path / "test.jsonl"), "--output", str(tmp_path / "single.jsonl")],
                            capture_output=True, text=True, env=env(), timeout=120)
    assert single.returncode == 0, single.stderr
    dist_rows = (tmp_path / "dist.jsonl").read_text()
    assert dist_rows == (tmp_path / "single.jsonl").read_text() and len(dist_rows.splitlines()) == 150
    assert any(json.loads(r)["admitted"] for r in dist_rows.splitlines())
    # --no-shard-index overrides the model's setting: every rank holds the whole index, same answers
    whole = launch(cli + ["predict", "--model", str(tmp_path / "model"), "--input", str(tmp_path / "test.jsonl"),
                          "--output", str(tmp_path / "whole.jsonl"), "--no-shard-index"])
    assert (tmp_path / "whole.jsonl").read_text() == dist_rows, whole.stderr


@needs_launch
def test_ranks_holding_different_support_sets_are_refused(tmp_path):
    run = launch([str(SCRIPT), "mismatch", str(tmp_path)])
    assert run.stderr.count("rank(s) [1] hold different support sets than rank 0") >= 1, run.stderr
    assert "exited with code 3" in run.stderr


# -- a rank that dies or hangs -----------------------------------------------------------------
BOUND = 30.0  #: seconds within which the surviving rank must have ended (measured: ~1-2 s for a death)


def _wait_for_error(proc: subprocess.Popen, bound: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the surviving rank did not end within {bound} s")
    return proc.returncode, err, time.monotonic() - t0


@needs_launch
def test_a_killed_rank_ends_the_other_with_a_clear_error(tmp_path):
    ranks = start_by_hand("loop", tmp_path)
    try:
        ranks[1].kill()
        code, err, seconds = _wait_for_error(ranks[0], BOUND)
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    assert code == 3 and seconds < BOUND
    assert "DistributedError: rank 0 of 2" in err and "another rank died" in err, err


@needs_launch
def test_a_hung_rank_ends_the_other_at_the_timeout(tmp_path):
    ranks = start_by_hand("loop", tmp_path, {"SDM_TEST_TIMEOUT": "4"})
    try:
        os.kill(ranks[1].pid, signal.SIGSTOP)  # alive, sockets open, never answers: the ring alone would wait
        code, err, seconds = _wait_for_error(ranks[0], BOUND)
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    # MLX cannot cancel a blocked collective: the watchdog ends the rank (exit 75) with the message
    assert code == dist.WATCHDOG_EXIT and 4 <= seconds < BOUND
    assert "sdm-mlx: error: rank 0 of 2: no answer from the other ranks within 4 s during " in err, err


@needs_launch
def test_sigterm_during_a_blocked_collective_ends_the_rank_at_once(tmp_path):
    """What mlx.launch sends once a rank fails: the blocked rank cannot run Python's handler, the watchdog can."""
    ranks = start_by_hand("loop", tmp_path, {"SDM_TEST_TIMEOUT": "120"})
    try:
        os.kill(ranks[1].pid, signal.SIGSTOP)  # rank 0 is soon blocked in a collective
        time.sleep(2.0)
        os.kill(ranks[0].pid, signal.SIGTERM)
        code, err, seconds = _wait_for_error(ranks[0], BOUND)
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    assert code == dist.WATCHDOG_EXIT and seconds < 10, (code, seconds, err)
    assert "sdm-mlx: error: rank 0 of 2: stopped by SIGTERM during " in err, err


@needs_launch
def test_under_mlx_launch_a_rank_that_dies_ends_the_run(tmp_path):
    t0 = time.monotonic()
    run = launch([str(SCRIPT), "selfkill", str(tmp_path)], timeout=BOUND + 30)
    assert time.monotonic() - t0 < BOUND + 10
    assert "Node with rank 1 exited with code -9" in run.stderr
    # rank 0 either sees the lost connection first or is stopped by mlx.launch's SIGTERM: both say why
    assert ("DistributedError: rank 0" in run.stderr
            or "sdm-mlx: error: rank 0 of 2: stopped by SIGTERM during " in run.stderr), run.stderr
