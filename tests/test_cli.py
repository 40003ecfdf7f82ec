"""The command line: JSON output, speculative meta_info, clear errors naming the flag."""

from __future__ import annotations

import json

import pytest

from specpilot.cli import main


def run_json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json(capsys, tiny_dir):
    out = run_json(capsys, "generate", "--model-path", str(tiny_dir), "--prompt", "w5 w6 w7 w5 w6",
                   "--max-new-tokens", "12", "--ignore-eos", "--json")
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == 12
    assert meta["prompt_tokens"] == 5 and meta["finish_reason"]["type"] == "length" and meta["e2e_latency"] > 0


def test_generate_speculative_meta_info_and_same_tokens(capsys, tiny_dir):
    base = ["generate", "--model-path", str(tiny_dir), "--prompt", "w5 w6 w7 w5 w6 w7 w5", "--max-new-tokens", "16",
            "--ignore-eos", "--json"]
    ar = run_json(capsys, *base)
    spec = run_json(capsys, *base, "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4")
    assert spec["output_ids"] == ar["output_ids"]
    meta = spec["meta_info"]
    assert meta["spec_verify_ct"] == sum(meta["spec_accept_histogram"][i] for i in range(len(meta["spec_accept_histogram"])))
    assert meta["spec_accept_length"] == pytest.approx(16 / meta["spec_verify_ct"])


@pytest.mark.parametrize("argv,flag", [
    (["generate", "--max-new-tokens", "-3"], "--max-new-tokens"),
    (["generate", "--device", "tpu"], "--device"),
    (["generate", "--speculative-algorithm", "medusa"], "--speculative-algorithm"),
    (["generate", "--speculative-num-draft-tokens", "1"], "--speculative-num-draft-tokens"),
    (["generate", "--speculative-eagle-topk", "0"], "--speculative-eagle-topk"),
    (["generate", "--mechanisms", "bogus"], "--mechanisms"),
    (["generate", "--profile", "/nonexistent/profile.json"], "--profile"),
    (["generate", "--attention-kv-splits", "-1"], "--attention-kv-splits"),
    (["generate", "--model-path", "/nonexistent/model"], "/nonexistent/model"),
    (["generate", "--top-p", "0"], "top_p"),
])
def test_bad_flags_name_the_problem(capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_bench_writes_json_with_the_settings_in_effect(tiny_dir, tmp_path):
    assert main(["bench", "--model-path", str(tiny_dir), "--dataset", "math", "--num-prompts", "2",
                 "--max-new-tokens", "8", "--speculative-algorithm", "ngram", "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_ngram_cpu.json").read_text())
    assert report["config"]["speculative_num_draft_tokens"] == 8  # the n-gram default, resolved
    assert report["speed"]["tunables"]["block-size"] == 8 and "device-acceptance" in report["speed"]["mechanisms"]
    [result] = report["results"]
    assert result["dataset"] == "math" and result["tau"] >= 1 and result["verify_passes"] > 0
    assert (tmp_path / "bench_ngram_cpu.png").is_file()
