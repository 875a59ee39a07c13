"""The host W_pos step (:mod:`sdm_mlx.network.host_step`) against MLX's autodiff step: the same losses, the same
Adam trajectory up to float rounding, the same Alg. 4 run through the CLI."""

import json

import mlx.core as mx
import numpy as np
import pytest

from sdm_mlx.errors import InputError
from sdm_mlx.llm.embed import load_model
from sdm_mlx.network.heads import SDMHeads
from sdm_mlx.network.host_step import HostTrainStep, host_step_supported
from sdm_mlx.network.step import make_optimizer, make_step, make_train_step


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_path):
    return load_model(tiny_qwen2_path)


def _batches(vocab, hidden, steps, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        n = 9
        h = (3 * rng.standard_normal((n, hidden))).astype(np.float32)
        t = rng.integers(0, vocab, n) + vocab
        t[0] -= vocab  # a target in the negative half
        q = rng.uniform(0, 6, n).astype(np.float32)
        q[1] = 0.0
        d = rng.uniform(0.2, 1.0, n).astype(np.float32)
        d[2] = 0.0  # d = 0: a uniform SDM output for this token
        yield h, t, q, d


def _run(model, kind, steps=4, lr=1e-2, beta=0.5):
    heads = SDMHeads(model)
    opt = make_optimizer(lr)
    w0 = np.array(heads.pos.weight)
    losses = []
    if kind == "host":
        step = HostTrainStep(heads, opt)
        step.begin()
    else:
        step = make_train_step(heads, opt, compile=kind == "compiled")
    for h, t, q, d in _batches(heads.vocab_size, heads.hidden_size, steps):
        if kind == "host":
            losses.append(step(h, t, q, d, beta))
        else:
            out = step(mx.array(h), mx.array(t.astype(np.int32)), mx.array(q), mx.array(d),
                       mx.array(beta, dtype=mx.float32))
            mx.eval(out, heads.state, opt.state)
            losses.append([float(x.item()) for x in out])
    if kind == "host":
        step.end()
    state = opt.state["pos"]["weight"]
    return (np.array(losses), w0, np.array(heads.pos.weight), np.array(state["m"]), np.array(state["v"]),
            int(np.array(opt.state["step"])))


@pytest.fixture(scope="module")
def phi3(tiny_phi3_path):
    return load_model(tiny_phi3_path)


@pytest.mark.parametrize("which,mlx_kind", [("qwen2", "eager"), ("qwen2", "compiled"), ("phi3", "eager")])
def test_host_step_follows_mlx_autodiff_step(which, mlx_kind, request):
    """Four Adam steps with both terms of the loss active (R > 1 after the first step), a negative-half target,
    q = 0 and d = 0 rows: losses within 1e-5 relative, W_pos, m and v within 1 % of how far they moved.  Tiny
    qwen2 ties its head to the embedding, tiny phi3 has its own ``lm_head``."""
    model, _ = request.getfixturevalue(which)
    want, w0, w_mlx, m_mlx, v_mlx, steps_mlx = _run(model, mlx_kind)
    got, _, w_host, m_host, v_host, steps_host = _run(model, "host")
    assert steps_host == steps_mlx == 4
    assert want[0, 2] == 0.0 and got[0, 2] == 0.0  # W_pos = W_ref: R = 0 exactly, in both
    assert (want[1:, 2] > 1).all()  # the regularizer's gradient is exercised
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    moved = np.abs(w_mlx - w0).max()
    assert moved > 1e-2
    assert np.abs(w_host - w_mlx).max() < 0.01 * moved
    assert np.abs(m_host - m_mlx).max() < 0.01 * np.abs(m_mlx).max()
    assert np.abs(v_host - v_mlx).max() < 0.01 * np.abs(v_mlx).max()


def test_host_step_is_chosen_on_cpu_and_refuses_a_quantised_reference(qwen2, tiny_phi3_path, tmp_path):
    model, _ = qwen2
    heads = SDMHeads(model)
    opt = make_optimizer(1e-3)
    assert host_step_supported(heads)
    assert isinstance(make_step(heads, opt, kind="auto"), HostTrainStep)  # the tests run MLX on the CPU
    assert not isinstance(make_step(heads, opt, kind="mlx"), HostTrainStep)
    with pytest.raises(InputError, match="train_step"):
        make_step(heads, opt, kind="gpu")
    import mlx.nn as nn

    qmodel, _ = load_model(tiny_phi3_path)
    nn.quantize(qmodel, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear)
                and m.weight.shape[0] >= 32 and m.weight.shape[1] % 32 == 0)
    assert hasattr(qmodel.lm_head, "scales")  # the head is quantised
    qheads = SDMHeads(qmodel)
    assert not host_step_supported(qheads)
    assert not isinstance(make_step(qheads, opt, kind="auto"), HostTrainStep)
    with pytest.raises(InputError, match="reference-head float32"):
        HostTrainStep(qheads, opt)
    assert host_step_supported(SDMHeads(qmodel, reference_head="float32"))


def test_host_step_needs_begin(qwen2):
    model, _ = qwen2
    heads = SDMHeads(model)
    step = HostTrainStep(heads, make_optimizer(1e-3))
    h, t, q, d = next(_batches(heads.vocab_size, heads.hidden_size, 1))
    with pytest.raises(RuntimeError, match="begin"):
        step(h, t, q, d, 0.1)


@pytest.mark.slow  # two CLI network-trains (~14 s CPU, 53 s at load 8); the default tier compares the two steps
#                    themselves (test_host_step_follows_mlx_autodiff_step)
def test_network_train_cli_host_and_mlx_steps_agree(tmp_path):
    """``sdm-mlx network-train --train-step host`` and ``--train-step mlx`` on the same tiny task: the same initial
    count, epoch counts and kept epoch within tests/helpers/count_tolerance.py, per-epoch losses within 1e-4
    relative (the default on a CPU is the host step)."""
    import subprocess
    import sys

    from count_tolerance import assert_same_counts_and_selection  # tests/helpers/
    from tiny_tool import make_tiny_model_tool  # tests/helpers/

    built = make_tiny_model_tool().build(str(tmp_path / "tiny"), rows=300, quiet=True)
    metrics = {}
    for kind in ("host", "mlx"):
        out = tmp_path / kind
        cmd = [sys.executable, "-m", "sdm_mlx", "network-train", "--model", built["model"], "--data", built["task"],
               "--preset", "sentiment", "--answers", "preset", "--output", str(out), "--epochs", "2",
               "--learning-rate", "1e-2", "--max-new-tokens", "12", "--generation-batch-size", "64",
               "--alpha", "0.8", "--verifier-iterations", "1", "--verifier-epochs", "20",
               "--verifier-exemplar-dim", "64", "--verifier-learning-rate", "3e-3",
               "--verifier-rescaler-max-epochs", "20", "--no-require-admission", "--train-step", kind, "--quiet"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        metrics[kind] = json.loads((out / "metrics.json").read_text())
    host, ref = metrics["host"], metrics["mlx"]
    assert host["initial"]["count"] == ref["initial"]["count"]  # the base head: no step yet, the same computation
    # the two steps give W_pos up to float rounding, and a count can move by a row on a boundary
    assert_same_counts_and_selection(host, ref)
    for a, b in zip(host["epochs"], ref["epochs"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["tokens"] == b["tokens"] > 0


def test_subnormal_probabilities_and_gradients_are_flushed(qwen2, monkeypatch):
    """A confident head (large hidden states) puts most softmax entries below 1.2e-38: the step flushes them, so
    the dW products never see subnormal operands (40x slower on x86), and the losses still equal MLX's step."""
    from sdm_mlx.network import host_step as H

    x = np.array([1e-39, -1e-40, 2e-38, -3.0, 0.0], dtype=np.float32)
    assert H._flush_subnormal(x) is x and x.tolist() == [0.0, 0.0, np.float32(2e-38), -3.0, 0.0]
    model, _ = qwen2
    seen = []
    adam = H.HostTrainStep._adam
    monkeypatch.setattr(H.HostTrainStep, "_adam", lambda self, grad, h: (seen.append(grad.copy()), adam(self, grad, h)))
    heads = SDMHeads(model)
    step = HostTrainStep(heads, make_optimizer(1e-2))
    step.begin()
    rng = np.random.default_rng(1)
    n = 6
    h = (400 * rng.standard_normal((n, heads.hidden_size))).astype(np.float32)  # logits spread over hundreds
    t = rng.integers(0, heads.vocab_size, n) + heads.vocab_size
    q, d = np.full(n, 5.0, np.float32), np.ones(n, np.float32)
    host_loss = step(h, t, q, d, 0.5)
    step.end()
    g = seen[0]
    assert np.all((g == 0) | (np.abs(g) >= np.finfo(np.float32).tiny))
    assert (g == 0).mean() > 0.3  # most entries underflowed and were flushed
    ref_heads = SDMHeads(model)
    ref = make_train_step(ref_heads, make_optimizer(1e-2), compile=False)
    out = ref(mx.array(h), mx.array(t.astype(np.int32)), mx.array(q), mx.array(d), mx.array(0.5, dtype=mx.float32))
    mx.eval(out)
    np.testing.assert_allclose(host_loss[:2], [float(v.item()) for v in out[:2]], rtol=1e-4)


def test_the_adam_pass_split_between_threads_is_the_single_threaded_pass(qwen2, monkeypatch):
    """The dW + Adam pass over three workers' row ranges (block edges inside none of them) gives the W_pos, m and v
    of the pass on the calling thread, and every block product runs with BLAS on one thread, restored after the
    step (the barrier of a multi-threaded product per block stalled whole epochs under steal time)."""
    from threadpoolctl import threadpool_info

    from sdm_mlx.network import host_step as H

    model, _ = qwen2
    seen_threads, workers = [], set()
    rows = H.HostTrainStep._rows

    def spy(self, worker, start, stop, *args):
        seen_threads.extend(lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas")
        workers.add(worker)
        return rows(self, worker, start, stop, *args)

    monkeypatch.setattr(H.HostTrainStep, "_rows", spy)
    before = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    results = {}
    for threads in (1, 3):
        heads = SDMHeads(model)
        opt = make_optimizer(1e-2)
        step = HostTrainStep(heads, opt, block_rows=16, threads=threads)
        step.begin()
        assert len(step._ranges) == min(threads, -(-heads.vocab_size // 16))
        assert all(j0 % 16 == 0 for j0, _ in step._ranges) and step._ranges[-1][1] == heads.vocab_size
        for h, t, q, d in _batches(heads.vocab_size, heads.hidden_size, 3):
            step(h, t, q, d, 0.5)
        step.end()
        assert step._pool is None  # end() stops the workers
        state = opt.state["pos"]["weight"]
        results[threads] = [np.array(a) for a in (heads.pos.weight, state["m"], state["v"])]
    assert workers == {0, 1, 2}
    assert seen_threads and set(seen_threads) == {1}
    assert [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"] == before
    for one, split in zip(results[1], results[3]):
        np.testing.assert_allclose(split, one, rtol=1e-6, atol=1e-12)
    with pytest.raises(InputError, match="threads"):
        HostTrainStep(SDMHeads(model), make_optimizer(1e-2), threads=0)
