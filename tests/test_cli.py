"""The command line: JSON output, speculative meta_info, clear errors naming the flag."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timedelta

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


def test_generate_with_a_grammar_and_logprobs(capsys, tiny_dir, tmp_path):
    pattern = tmp_path / "pattern.txt"
    pattern.write_text("(w5|w6){2,5}w7")
    out = run_json(capsys, "generate", "--model-path", str(tiny_dir), "--prompt", "w5 w6", "--max-new-tokens", "12",
                   "--regex", f"@{pattern}", "--logprobs", "2", "--json", "--speculative-algorithm", "ngram")
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and out["text"].replace(" ", "")[-2:] == "w7"
    assert len(out["logprobs"]) == len(out["output_ids"]) and all(len(e["top"]) == 2 for e in out["logprobs"])


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
    (["generate", "--regex", "@/nonexistent/pattern"], "--regex"),
    (["generate", "--regex", "a", "--ebnf", 'root ::= "a"'], "at most one of"),
])
def test_bad_flags_name_the_problem(capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_bench_writes_json_with_the_settings_in_effect(tiny_dir, tmp_path, capsys):
    assert main(["bench", "--model-path", str(tiny_dir), "--dataset", "math", "--num-prompts", "2",
                 "--max-new-tokens", "8", "--speculative-algorithm", "ngram", "--repeats", "2",
                 "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_ngram_cpu.json").read_text())
    assert report["config"]["speculative_num_draft_tokens"] == 8  # the n-gram default, resolved
    assert report["speed"]["tunables"]["block-size"] == 8 and "device-acceptance" in report["speed"]["mechanisms"]
    [result] = report["results"]
    assert result["dataset"] == "math" and result["tau"] >= 1 and result["verify_passes"] > 0
    assert (tmp_path / "bench_ngram_cpu.png").is_file()
    # every repeat's raw numbers, and the medians and ranges the table prints
    assert report["repeats"] == 2 and len(result["repeats"]) == 2
    for rep in result["repeats"]:
        assert rep["speedup"] == pytest.approx(rep["ar"]["tpot_ms"] / rep["spec"]["tpot_ms"])
        assert rep["tau"] == result["tau"] and rep["verify_passes"] == result["verify_passes"]  # greedy
    spread = result["spread"]
    for key, median in (("ar_tpot_ms", result["ar"]["tpot_ms"]), ("spec_tpot_ms", result["spec"]["tpot_ms"]),
                        ("speedup", result["speedup"]), ("tau", result["tau"])):
        stat = spread[key]
        assert len(stat["values"]) == 2 and stat["min"] <= stat["median"] <= stat["max"]
        assert stat["median"] == pytest.approx(median) and median == pytest.approx(sum(stat["values"]) / 2)
    table = capsys.readouterr().out
    assert f"{spread['speedup']['median']:.2f}×" in table and f"({spread['speedup']['min']:.2f}–" in table
    # the second AR repeat and both speculative ones, request by request against the first AR repeat's ids
    ids = result["identical_ids"]
    assert ids["ar_repeats"] == [2] and len(ids["spec_repeats"]) == 2 and "2/2" in table


def test_batched_bench_reports_throughputs_speedup_and_the_occupancy_behind_it(tiny_dir, tmp_path, capsys):
    """At --batch-size > 1 the speedup that counts is throughput's; it differs from TPOT's by how much of the
    batch's slot time each mode spends decoding (prefills, and a batch's tail waiting for its longest)."""
    assert main(["bench", "--model-path", str(tiny_dir), "--dataset", "math", "--num-prompts", "4", "--batch-size", "2",
                 "--max-new-tokens", "8", "--speculative-algorithm", "ngram", "--repeats", "1",
                 "--output-dir", str(tmp_path)]) == 0
    [result] = json.loads((tmp_path / "bench_ngram_cpu.json").read_text())["results"]
    [rep] = result["repeats"]
    assert rep["throughput_speedup"] == pytest.approx(rep["spec"]["tokens_per_s"] / rep["ar"]["tokens_per_s"])
    assert result["throughput_speedup"] == pytest.approx(rep["throughput_speedup"])
    assert all(0 < run["occupancy"] <= 1 for run in (rep["ar"], rep["spec"]))
    out = capsys.readouterr().out  # a narrow terminal folds the headers; the cells stay whole
    assert f"{rep['ar']['occupancy']:.0%} /" in out and f"{result['throughput_speedup']:.2f}×" in out


def test_bench_records_provenance(tiny_dir, tmp_path):
    assert main(["bench", "--model-path", str(tiny_dir), "--dataset", "math", "--num-prompts", "1",
                 "--max-new-tokens", "2", "--repeats", "1", "--output-dir", str(tmp_path)]) == 0
    prov = json.loads((tmp_path / "bench_ar_cpu.json").read_text())["provenance"]
    assert set(prov) == {"git", "device", "cpu", "dtype", "versions", "argv", "utc"}
    assert prov["dtype"] == "torch.float32" and prov["device"] == prov["cpu"] and "cores" in prov["cpu"]
    assert set(prov["versions"]) == {"python", "specpilot", "torch", "triton", "transformers"}
    assert prov["versions"]["torch"] and prov["versions"]["specpilot"]
    assert prov["git"] is None or (set(prov["git"]) == {"commit", "dirty"} and prov["git"]["commit"])
    assert datetime.fromisoformat(prov["utc"]).utcoffset() == timedelta(0)


def test_git_state_of_a_checkout_and_of_none(tmp_path):
    from specpilot.bench.provenance import git_state

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *argv], check=True, capture_output=True,
                              text=True).stdout.strip()

    assert git_state(tmp_path) is None
    git("init", "-q")
    (tmp_path / "f").write_text("a")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    assert git_state(tmp_path) == {"commit": git("rev-parse", "--short", "HEAD"), "dirty": False}
    (tmp_path / "untracked").write_text("b")
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "f").write_text("changed")
    assert git_state(tmp_path)["dirty"] is True
    (tmp_path / "sub").mkdir()
    assert git_state(tmp_path / "sub") is None  # inside a checkout, but not its top level
