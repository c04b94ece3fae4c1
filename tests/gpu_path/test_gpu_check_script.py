"""bench/gpu_check.py's parts on CPU: the random checkpoint loads in transformers and in our engine with
equal logits, the divergence analysis, the summary table (including failed and skipped steps), and the
warm-up (bench/gpu_warmup.py). `bench/gpu_check.sh --cpu-smoke` runs the whole script on CPU (minutes)."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from bench import gpu_check, gpu_warmup
from services.engine import LLM


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("gpu-check-tiny"))
    gpu_check.main(["build", "--shape", "tiny-qwen3", "--out", directory])
    return directory


def test_random_checkpoint_gives_the_same_logits_in_transformers_and_ours(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, local_files_only=True).eval()
    ours = LLM(tiny_checkpoint, device="cpu", dtype="float32", num_kvcache_blocks=16)
    ids = [5, 900, 17, 33, 402, 8, 1000]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours.runner.score(ids), expected, rtol=1e-4, atol=1e-4)
    assert expected.std() > 1.0, "the init must give peaked, not flat, logits"


def test_building_twice_reuses_the_checkpoint(tiny_checkpoint, capsys):
    gpu_check.main(["build", "--shape", "tiny-qwen3", "--out", tiny_checkpoint])
    assert "already holds" in capsys.readouterr().out


def test_divergence_is_reported_with_its_gap(tiny_checkpoint):
    reference = LLM(tiny_checkpoint, device="cpu", dtype="float32", num_kvcache_blocks=16)
    prompt = [7, 8, 9, 10]
    logits = reference.runner.score(prompt)[-1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert gpu_check.first_divergence(reference, prompt, [best], [best]) is None
    far = gpu_check.first_divergence(reference, prompt, [best], [worst])
    assert far["step"] == 0 and not far["near_tie"] and far["got_rank"] is None and far["gap_over_std"] > 1.0


def _results(tmp_path, steps: dict[str, int], equiv_status: str = "pass"):
    for name, rc in steps.items():
        (tmp_path / f"{name}.rc").write_text(f"{rc} 12")
    (tmp_path / "kernels.log").write_text("....\n===== 10 passed, 2 skipped in 3.2s =====\n")
    (tmp_path / "equiv.json").write_text(json.dumps(
        {"status": equiv_status, "exact": 7, "total": 8, "divergences": [{"gap_over_std": 0.02, "near_tie": True}],
         "device": "NVIDIA H200", "dtype": "bfloat16", "backend": "triton", "cuda_graphs": True, "model": "smollm2",
         "decode_tok_s": 612.0}))
    (tmp_path / "offline.json").write_text(json.dumps(
        {"tok_s": 9000.0, "tokens": 100, "seconds": 1.0, "preemptions": 0, "cuda_graphs": True, "num_seqs": 256}))
    (tmp_path / "hf.json").write_text(json.dumps(
        {"num_seqs": 32, "hf": {"tok_s": 800.0}, "ours": {"tok_s": 4000.0}, "ratio": 5.0}))


def test_table_passes_only_when_every_step_did(tmp_path):
    _results(tmp_path, {"kernels": 0, "equiv": 0, "offline": 0, "hf": 0})
    rows, passed = gpu_check.table_rows(tmp_path)
    table = dict(rows)
    assert passed and table["ratio ours / HF (slice)"] == "5.00x"
    assert table["kernel + gpu_path tests"] == "PASS: 10 passed, 2 skipped in 3.2s"
    assert "612.0 tok/s" in table["single-stream decode"]


@pytest.mark.parametrize("kernels_rc, equiv_status, expected", [(124, "pass", "timeout after 12s"),
                                                              (0, "fail", "FAIL: 7/8 exact")])
def test_table_fails_on_a_timeout_or_a_divergence(tmp_path, kernels_rc, equiv_status, expected):
    _results(tmp_path, {"kernels": kernels_rc, "equiv": 0, "offline": 0, "hf": 0}, equiv_status)
    rows, passed = gpu_check.table_rows(tmp_path)
    assert not passed and any(expected in value for _, value in rows)


def test_table_command_exits_nonzero_on_a_missing_step(tmp_path, capsys):
    _results(tmp_path, {"kernels": 0, "equiv": 0, "offline": 0})
    (tmp_path / "hf.json").unlink()
    (tmp_path / "hf.rc").write_text("125 0")
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["table", "--results", str(tmp_path)])
    assert exit_info.value.code == 1
    assert "skipped: no time left" in capsys.readouterr().out


def test_the_warm_up_is_shown_but_never_judged(tmp_path):
    _results(tmp_path, {"warmup": 124, "kernels": 0, "equiv": 0, "offline": 0, "hf": 0})
    (tmp_path / "warmup.log").write_text("C++ CPU decode kernel built in 20.0s\n8 test files in parallel: 90.1s\n")
    rows, passed = gpu_check.table_rows(tmp_path)
    assert passed and rows[0] == ("warm-up (not judged)", "timeout after 12s: 8 test files in parallel: 90.1s")


def test_warm_up_runs_each_test_file_in_its_own_pytest_and_reports_each(tmp_path):
    (tmp_path / "test_good.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "test_bad.py").write_text("def test_not_ok():\n    assert False\n")
    (tmp_path / "helpers.py").write_text("")
    lines = gpu_warmup.run_in_parallel(gpu_warmup.test_files([str(tmp_path)]))
    assert "test_bad.py: 1 failed" in lines[0] and lines[0].endswith("(exit 1)")
    assert "test_good.py: 1 passed" in lines[1] and lines[1].endswith("(exit 0)")
    assert lines[2].startswith("2 test files in parallel: ")


def test_warm_up_refuses_a_path_that_does_not_exist(tmp_path):
    with pytest.raises(SystemExit, match="no such test path"):
        gpu_warmup.test_files([str(tmp_path / "missing")])


def test_the_script_parses():
    script = Path(gpu_check.__file__).with_name("gpu_check.sh")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
