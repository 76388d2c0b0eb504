"""lab/attach_demo.py at a toy size: the runs, their logs and figure, the cost table; and its one-line
refusal of a Hugging Face model where transformers is missing."""
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["abc", "argparse", "ast", "bisect", "calendar", "contextlib", "copy", "csv", "dataclasses", "datetime",
         "difflib", "enum", "functools", "inspect", "pathlib", "pprint", "random", "textwrap", "tokenize", "typing"]


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory):
    import prepare_data
    stdlib = sysconfig.get_paths()["stdlib"]
    out = tmp_path_factory.mktemp("data")
    prepare_data.prepare(dataset="text", out_dir=str(out), val_fraction=0.2, tokenizer="byte",
                         inputs=[os.path.join(stdlib, n + ".py") for n in NAMES])
    return str(out)


def demo(*args, hide_transformers=False):
    hide = "import sys; sys.modules['transformers'] = None; " if hide_transformers else ""
    code = f"{hide}import sys; from lab.attach_demo import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_the_demo_guards_a_nanogpt_and_measures_its_cost(tmp_path, byte_data):
    png, summary = tmp_path / "attach.png", tmp_path / "summary.json"
    result = demo("--model", "nanogpt", "--data-dir", byte_data, "--out-dir", str(tmp_path / "runs"), "--png", str(png),
                  "--steps", "30", "--block-size", "32", "--batch-size", "4", "--threshold", "20", "--cost-steps", "3",
                  "--cost-intervals", "1", "--json", str(summary))
    assert result.returncode == 0, result.stderr[-3000:]
    off, on = (read(tmp_path / "runs" / "nanogpt" / d / "log.jsonl") for d in ("guard-off", "guard-on"))
    trigger = [r for r in on if r.get("event") == "guard_trigger"]
    assert len(trigger) == 1 and trigger[0]["value"] > 20 and not any(r.get("event") == "guard_trigger" for r in off)
    steps_on = [r for r in on if "loss" in r]
    assert len(steps_on) == 30 and {"max_logit", "sigma_q", "sigma_q_head", "guard"} <= set(steps_on[0])
    assert steps_on[-1]["guard"] == "on" and max(map(max, steps_on[-1]["max_logit"])) <= 32 ** 0.5 * (1 + 1e-5)
    assert on[-1]["event"] == "end" and on[-1]["guard_trigger"]["step"] == trigger[0]["step"]
    with open(tmp_path / "runs" / "nanogpt" / "guard-on" / "config.json") as f:
        assert json.load(f)["args"]["guard_threshold"] == 20.0           # the threshold the guard ran under
    report = json.loads(summary.read_text())
    assert [c["bit_for_bit"] for c in report["cost"]] == [True, True] and report["cost"][1]["in_guard_ms"] > 0
    assert "| nanogpt | 1 | every 1, 1 seq x all rows | 3 |" in result.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.exists()


def test_a_hugging_face_model_without_transformers_is_one_clear_line(byte_data):
    result = demo("--model", "hf-gpt2", "--data-dir", byte_data, hide_transformers=True)
    assert result.returncode != 0
    assert result.stderr.strip() == ("error: --model hf-gpt2 needs the transformers package: pip install "
                                     "transformers (or run --model nanogpt)")
