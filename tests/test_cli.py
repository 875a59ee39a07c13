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
