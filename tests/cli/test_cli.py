import subprocess
import sys

import pytest

from sdm_mlx.cli import VERBS, build_parser, main


def test_every_verb_is_registered_and_documented(capsys):
    _, subparsers = build_parser()
    assert set(subparsers) == set(VERBS)
    for verb in VERBS:
        with pytest.raises(SystemExit) as e:
            main([verb, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "--config" in out
        if verb == "train":
            assert "(default: 0.95)" in out  # defaults are shown


def test_python_dash_m_and_exit_codes():
    r = subprocess.run([sys.executable, "-m", "sdm_mlx", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and "sdm-mlx" in r.stdout
    r = subprocess.run([sys.executable, "-m", "sdm_mlx"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
    r = subprocess.run([sys.executable, "-m", "sdm_mlx", "predict", "--model", "/nonexistent", "--input", "x"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no model artifact" in r.stderr


def test_help_does_not_import_mlx():
    code = ("import sys, sdm_mlx.cli as c; c.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout


@pytest.mark.parametrize("raised, code, says", [
    (lambda: __import__("sdm_mlx.errors").errors.InputError("rows.jsonl: line 3: label 'x' is unknown"), 2,
     "sdm-mlx inspect: error: rows.jsonl: line 3: label 'x' is unknown"),
    (lambda: ValueError("operands could not be broadcast together"), 1,
     "sdm-mlx inspect: internal error (a bug in sdm_mlx, not a problem with your input): ValueError: operands"),
    (lambda: KeyError("prediction"), 1, "internal error (a bug in sdm_mlx"),
])
def test_only_sdm_errors_are_reported_as_the_users_fault(monkeypatch, capsys, raised, code, says):
    """Issue 11 §3: SDMError (and OSErrors of user paths) are user errors (exit 2); any other exception is a
    defect and says so (exit 1, the traceback behind SDM_MLX_DEBUG=1)."""
    import sdm_mlx.commands.inspect as inspect_verb

    def boom(args):
        raise raised()

    monkeypatch.setattr(inspect_verb, "run", boom)
    monkeypatch.delenv("SDM_MLX_DEBUG", raising=False)
    assert main(["inspect", "--model", "anything"]) == code
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    monkeypatch.setenv("SDM_MLX_DEBUG", "1")
    with pytest.raises(type(raised())):
        main(["inspect", "--model", "anything"])
