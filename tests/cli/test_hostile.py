"""Hostile paths and bad inputs through the CLI: every case must fail with
``sdm-mlx <verb>: error: <message naming the problem>``, exit != 0, no traceback, and leave every
pre-existing file of the sandbox byte-identical (a snapshot of the sandbox is compared)."""

import json
import os
import shutil

import pytest

from cli_lab import TINY, cli, rows, snapshot, write_rows  # tests/helpers/ (the lab fixture: conftest.py)


# ------------------------------------------------------------------------------------ the battery
def _bad_rows(edit):
    def setup(box):
        rs = rows(12, seed=1)
        edit(rs)
        write_rows(box / "bad.jsonl", rs)
        return ["predict", "--model", "model", "--input", "bad.jsonl", "--output", "out.jsonl"]
    return setup


def _set(i, key, value):
    def edit(rs):
        rs[i][key] = value
    return edit


def _train_rows(rs, *extra):
    def setup(box):
        write_rows(box / "t.jsonl", rs)
        return ["train", "--train", "t.jsonl", "--output", "newmodel", *TINY, *extra]
    return setup


def _predict(*extra, inp="test.jsonl"):
    return lambda box: ["predict", "--model", "model", "--input", inp, *extra]


def _with(prep, argv):
    def setup(box):
        prep(box)
        return argv(box) if callable(argv) else argv
    return setup


def _foreign_dir(box, name="foreign"):
    (box / name).mkdir()
    (box / name / "notes.txt").write_text("mine\n")
    (box / name / "sub").mkdir()
    (box / name / "sub" / "keep.bin").write_bytes(b"\x00\x01")


def _symlink_to_test(box):
    os.symlink("test.jsonl", box / "link.jsonl")


def _manifest(box, text):
    (box / "model" / "manifest.json").write_text(text)


def _edit_manifest(box, fn):
    m = json.loads((box / "model" / "manifest.json").read_text())
    fn(m)
    (box / "model" / "manifest.json").write_text(json.dumps(m))


def _flip_weights(box):
    p = box / "model" / "adaptor.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))


def _yaml(box, text):
    (box / "c.yaml").write_text(text)


def _readonly(box):
    (box / "ro").mkdir()
    os.chmod(box / "ro", 0o555)


def _run_dir(box, kind):
    (box / "run").mkdir()
    (box / "run" / ".sdm_mlx_run.json").write_text(json.dumps({"format": "sdm_mlx_run", "kind": kind}))
    (box / "run" / "report.json").write_text("{}")


def _model_inside(box):
    (box / "d").mkdir()
    shutil.copy(box / "train.jsonl", box / "d" / "train.jsonl")


_NET = ["network-train", "--model", "no-such/model", "--preset", "sentiment", "--data", "train.jsonl"]

CASES = {
    # outputs that are inputs, directories, links, unwritable places
    "predict_output_is_input": (_predict("--output", "test.jsonl"), "same file as --input"),
    "predict_output_symlink_to_input": (_with(_symlink_to_test, _predict("--output", "link.jsonl")), "same file"),
    "predict_summary_is_input": (_predict("--summary", "test.jsonl"), "--summary test.jsonl is the same file"),
    "predict_output_equals_summary": (_predict("--output", "o.json", "--summary", "o.json"), "same file"),
    "predict_input_via_symlink_output_real": (_with(_symlink_to_test, _predict("--output", "test.jsonl",
                                                                               inp="link.jsonl")), "same file"),
    "predict_output_into_model_dir": (_predict("--output", "model/manifest.json"), "inside the --model directory"),
    "evaluate_report_into_model_dir": (lambda b: ["evaluate", "--model", "model", "--input", "test.jsonl", "--report",
                                                  "model/report.json"], "inside the --model directory"),
    "predict_output_is_directory": (_with(_foreign_dir, _predict("--output", "foreign")), "is a directory"),
    "predict_output_parent_is_file": (_predict("--output", "train.jsonl/p.jsonl"), "train.jsonl"),
    "predict_output_readonly_dir": (_with(_readonly, _predict("--output", "ro/p.jsonl")), "ermission denied"),
    "predict_output_dev_full": (_predict("--output", "/dev/full"), "No space left"),
    # bad rows
    "malformed_json": (_with(lambda b: write_rows(b / "bad.jsonl", [json.dumps(rows(2)[0]), '{"id": 1, "emb']),
                             _predict("--output", "o.jsonl", inp="bad.jsonl")), "bad.jsonl:2: malformed JSON"),
    "nan_feature": (_bad_rows(_set(3, "embedding", [float("nan")] * 6)), "bad.jsonl:4: features contain NaN"),
    "inf_feature": (_bad_rows(_set(5, "embedding", [1e400] + [0.0] * 5)), "bad.jsonl:6: features contain NaN or Inf"),
    "string_feature": (_bad_rows(_set(2, "embedding", ["a"] * 6)), "bad.jsonl:3: features must be flat lists"),
    "nested_feature": (_bad_rows(_set(2, "embedding", [[1.0]] * 6)), "bad.jsonl:3"),
    "empty_feature": (_bad_rows(_set(0, "embedding", [])), "non-empty list"),
    "ragged_width": (_bad_rows(_set(4, "embedding", [0.0] * 5)), "bad.jsonl:5: feature vector has 5 values"),
    "wrong_width_for_model": (_with(lambda b: write_rows(b / "w.jsonl", [{"id": 1, "attributes": [0.0] * 4}]),
                                    _predict("--output", "o.jsonl", inp="w.jsonl")), "w.jsonl.*--features"),
    "wrong_field_forced": (_predict("--output", "o.jsonl", "--features", "attributes"), "test.jsonl.*expects 6"),
    "unknown_label": (_bad_rows(_set(1, "label", 7)), r"labels must lie in 0\.\.1"),
    "negative_label": (_bad_rows(_set(1, "label", -1)), r"labels must lie in 0\.\.1"),
    "bool_label": (_bad_rows(_set(1, "label", True)), "bad.jsonl:2: label must be an integer"),
    "float_label": (_bad_rows(_set(1, "label", 1.0)), "bad.jsonl:2: label must be an integer"),
    "string_label": (_bad_rows(_set(1, "label", "1")), "label '1' is a string, and labels are class indices 0..C-1"),
    "duplicate_ids": (_bad_rows(_set(5, "id", 0)), "bad.jsonl:6: duplicate id 0"),
    "missing_id": (_bad_rows(lambda rs: rs[2].pop("id")), "bad.jsonl:3: missing field 'id'"),
    "line_not_object": (_with(lambda b: write_rows(b / "bad.jsonl", ["[1, 2]"]),
                              _predict("--output", "o.jsonl", inp="bad.jsonl")), "must be a JSON object"),
    "empty_file": (_with(lambda b: write_rows(b / "bad.jsonl", []), _predict("--output", "o.jsonl", inp="bad.jsonl")),
                   "bad.jsonl: no rows"),
    "not_utf8": (_with(lambda b: (b / "bad.jsonl").write_bytes(b'{"id": "\xff\xfe"}\n'),
                       _predict("--output", "o.jsonl", inp="bad.jsonl")), "bad.jsonl:1: not UTF-8"),
    "input_is_directory": (_with(_foreign_dir, _predict("--output", "o.jsonl", inp="foreign")), "is a directory"),
    "input_missing": (_predict("--output", "o.jsonl", inp="nope.jsonl"), "input file not found: nope.jsonl"),
    # models
    "model_missing": (lambda b: ["predict", "--model", "nomodel", "--input", "test.jsonl"], "no model artifact"),
    "model_manifest_not_json": (_with(lambda b: _manifest(b, "{oops"), _predict()), "manifest.json is corrupt"),
    "model_manifest_not_object": (_with(lambda b: _manifest(b, "[1, 2]"), _predict()), "expected a JSON object"),
    "model_tampered_weights": (_with(_flip_weights, _predict()), "checksum mismatch for adaptor"),
    "model_tampered_meta": (_with(lambda b: _edit_manifest(b, lambda m: m["meta"].update(k=1)), _predict()),
                            "manifest was modified"),
    "model_wrong_version": (_with(lambda b: _edit_manifest(b, lambda m: m.update(format_version=99)), _predict()),
                            "format version 99"),
    "model_is_a_file": (lambda b: ["predict", "--model", "train.jsonl", "--input", "test.jsonl"], "no model artifact"),
    # config files
    "yaml_unknown_key": (_with(lambda b: _yaml(b, "modle: model\n"), ["predict", "--config", "c.yaml"]),
                         "unknown key.*modle"),
    "yaml_not_mapping": (_with(lambda b: _yaml(b, "- 1\n"), ["predict", "--config", "c.yaml"]), "mapping"),
    "yaml_invalid": (_with(lambda b: _yaml(b, "a: [\n"), ["predict", "--config", "c.yaml"]), "not valid YAML"),
    # training data
    "single_class": (_train_rows([{**r, "label": 0} for r in rows()]), "at least two classes"),
    "too_small_calibration": (_train_rows(rows(6)), "fewer than 4 rows"),
    "train_mixed_fields": (_train_rows([{k: v for k, v in r.items() if k != "attributes"} if r["id"] == 3 else r
                                        for r in rows()]), "t.jsonl:4:.*--features"),
    "train_calibration_width": (_with(lambda b: write_rows(b / "c.jsonl", rows(20, both=False)),
                                      ["train", "--train", "train.jsonl", "--calibration", "c.jsonl", "--output",
                                       "m2", "--features", "attributes", *TINY]), "c.jsonl"),
    "train_report_is_input": (lambda b: ["train", "--train", "train.jsonl", "--output", "m2",
                                         "--report", "train.jsonl", *TINY], "same file as --train"),
    # model directories
    "train_output_holds_training_file": (_with(_model_inside, ["train", "--train", "d/train.jsonl", "--output", "d",
                                                              *TINY]), "contains the input --train"),
    "train_output_dot": (lambda b: ["train", "--train", "train.jsonl", "--output", ".", *TINY], "working directory"),
    "train_output_parent_of_cwd": (lambda b: ["train", "--train", "train.jsonl", "--output", "..", *TINY],
                                   "working directory"),
    "train_output_foreign_dir": (_with(_foreign_dir, ["train", "--train", "train.jsonl", "--output", "foreign",
                                                      *TINY]), "not an sdm_mlx artifact"),
    "train_output_existing_model": (lambda b: ["train", "--train", "train.jsonl", "--output", "model", *TINY],
                                    "--overwrite"),
    "train_output_is_file": (lambda b: ["train", "--train", "train.jsonl", "--output", "test.jsonl", *TINY],
                             "not a directory"),
    "recalibrate_in_place_needs_overwrite": (lambda b: ["recalibrate", "--model", "model", "--alpha", "0.7"],
                                             "--overwrite"),
    "recalibrate_output_foreign": (_with(_foreign_dir, ["recalibrate", "--model", "model", "--alpha", "0.7",
                                                        "--output", "foreign", "--overwrite"]),
                                   "not an sdm_mlx artifact"),
    "recalibrate_output_dot": (lambda b: ["recalibrate", "--model", "model", "--alpha", "0.7", "--output", ".",
                                          "--overwrite"], "working directory"),
    # other verbs
    "evaluate_report_is_input": (lambda b: ["evaluate", "--model", "model", "--input", "test.jsonl", "--report",
                                            "test.jsonl"], "same file"),
    "evaluate_label_errors_is_input": (lambda b: ["evaluate", "--model", "model", "--input", "train.jsonl",
                                                  "--input", "test.jsonl", "--label-errors", "test.jsonl"],
                                       "same file"),
    "demo_output_foreign": (_with(_foreign_dir, ["demo", "--quick", "--output", "foreign"]), "did not create"),
    "demo_output_dot": (lambda b: ["demo", "--quick", "--output", "."], "working directory"),
    "demo_earlier_run_needs_overwrite": (_with(lambda b: _run_dir(b, "demo"), ["demo", "--quick", "--output", "run"]),
                                         "--overwrite"),
    "demo_into_network_run": (_with(lambda b: _run_dir(b, "network-train"), ["demo", "--quick", "--output", "run",
                                                                             "--overwrite"]), "network-train"),
    "network_train_output_foreign": (_with(_foreign_dir, [*_NET, "--output-dir", "foreign"]), "did not create"),
    "network_train_output_holds_data": (lambda b: [*_NET, "--output-dir", "."], "working directory"),
    "network_train_earlier_run": (_with(lambda b: _run_dir(b, "network-train"), [*_NET, "--output-dir", "run"]),
                                  "--overwrite"),
    "api_features_output_is_input": (lambda b: ["api-features", "--input", "test.jsonl", "--output", "test.jsonl"],
                                     "same file"),
    "make_verification_data_output_is_input": (lambda b: ["make-verification-data", "--input", "test.jsonl",
                                                          "--output", "test.jsonl"], "same file"),
    "embed_output_is_input": (lambda b: ["embed", "--model", "x", "--input", "test.jsonl", "--output", "test.jsonl"],
                              "same file"),
    "generate_output_is_input": (_with(_symlink_to_test, ["generate", "--model", "x", "--verifier", "model",
                                                          "--input", "test.jsonl", "--output", "link.jsonl"]),
                                 "same file"),
}


def _run_case(case, lab, root):
    """Copy the lab to a fresh sandbox, set the case up, snapshot, run the CLI, snapshot again."""
    setup, _ = CASES[case]
    box = root / case
    shutil.copytree(lab, box, symlinks=True)
    argv = setup(box)
    before = snapshot(box)
    prefix = ()
    if case == "predict_output_readonly_dir" and os.geteuid() == 0:
        if not shutil.which("setpriv"):
            return None
        prefix = ("setpriv", "--bounding-set=-dac_override", "--inh-caps=-dac_override")
    r = cli(*argv, cwd=box, prefix=prefix)
    return argv, before, r, snapshot(box)


@pytest.fixture(scope="module")
def battery(lab, tmp_path_factory):
    """Every case, run a few at a time (each in its own sandbox) to keep the battery fast."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("battery")
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {case: pool.submit(_run_case, case, lab, root) for case in sorted(CASES)}
        return {case: f.result() for case, f in futures.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile(case, battery):
    import re

    if battery[case] is None:
        pytest.skip("running as root without setpriv: a read-only directory is writable")
    argv, before, r, after = battery[case]
    expected = CASES[case][1]
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert f"sdm-mlx {argv[0]}: error:" in r.stderr, r.stderr
    assert re.search(expected, r.stderr), r.stderr
    assert ".sdm-tmp" not in r.stderr and ".tmp-" not in r.stderr  # never a temporary name
    assert {k: v for k, v in after.items() if k in before} == before  # nothing pre-existing changed
    new = set(after) - set(before)
    assert not [n for n in new if "sdm-tmp" in n or "sdm-previous" in n], new


def test_battery_is_big_enough():
    assert len(CASES) >= 40
