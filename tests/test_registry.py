"""The registry of speed settings: parsing and resolving mechanisms, the tunables' checks, profiles, the
CLI's flags and listing, and what the engine, /get_server_info and bench report."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from spec_fixtures import write_random_dflash
from test_server_support import serve

from specpilot.cli import build_parser, engine_config_from_args, main
from specpilot.drafters.base import Capabilities
from specpilot.engine.config import EngineConfig
from specpilot.engine.engine import Engine
from specpilot.engine.registry import (
    MECHANISMS,
    NEEDS,
    STOCK,
    TUNABLES,
    Deployment,
    Profile,
    ar_changes,
    check_tunables,
    in_effect,
    parse_mechanisms,
    resolve_mechanisms,
    shipped_profiles,
)

ALL = frozenset(m.name for m in MECHANISMS if m.by_default)
DFLASH_TREES = EngineConfig(speculative_algorithm="dflash", speculative_eagle_topk=4, speculative_ngram_assist=2)
DFLASH_CAPS = Capabilities(early_launch=True, trees=True, device_lookup=True, graphs=True)


def test_parse_mechanisms():
    assert parse_mechanisms(STOCK) == frozenset()
    assert parse_mechanisms(" device-acceptance,early-launch ") == {"device-acceptance", "early-launch"}
    for bad in ("bogus", "device-acceptance,bogus", "", "stock,early-launch"):
        with pytest.raises(ValueError, match="^--mechanisms: unknown"):
            parse_mechanisms(bad)


def test_needs_name_mechanisms_listed_before_them():
    order = [m.name for m in MECHANISMS]
    for name, needs in NEEDS.items():
        assert all(order.index(n) < order.index(name) for n in needs)


def test_resolve_mechanisms_default_is_every_one_that_holds():
    assert resolve_mechanisms(None, Deployment("cuda", DFLASH_TREES, DFLASH_CAPS, graphs=True)) == ALL
    assert resolve_mechanisms(None, Deployment("cpu", DFLASH_TREES, DFLASH_CAPS)) == ALL - {"layout-ahead", "overlap"}
    chain = replace(DFLASH_TREES, speculative_eagle_topk=1)
    assert resolve_mechanisms(None, Deployment("cuda", chain, DFLASH_CAPS, graphs=True)) == ALL - {"device-lookup"}
    ngram = EngineConfig(speculative_algorithm="ngram")
    assert resolve_mechanisms(None, Deployment("cuda", ngram, Capabilities(), graphs=True)) == {
        "device-acceptance", "layout-ahead", "overlap"}
    assert resolve_mechanisms(None, Deployment("cuda", EngineConfig(), None, graphs=True)) == {"overlap"}
    assert resolve_mechanisms(None, Deployment("cuda", EngineConfig(), None)) == frozenset()  # no graphs


def test_resolve_mechanisms_explicit_set_must_hold():
    here = Deployment("cuda", DFLASH_TREES, DFLASH_CAPS, graphs=True)
    assert resolve_mechanisms(frozenset(), here) == frozenset()
    assert resolve_mechanisms({"device-acceptance"}, here) == {"device-acceptance"}
    with pytest.raises(ValueError, match="--mechanisms: early-launch needs device-acceptance too"):
        resolve_mechanisms({"early-launch"}, here)
    with pytest.raises(ValueError, match="--mechanisms: layout-ahead needs CUDA graphs"):
        resolve_mechanisms({"device-acceptance", "layout-ahead"}, replace(here, graphs=False))
    with pytest.raises(ValueError, match="--mechanisms: early-launch needs a drafter that launches early"):
        resolve_mechanisms({"device-acceptance", "early-launch"}, replace(here, capabilities=Capabilities()))
    with pytest.raises(ValueError, match="--mechanisms: device-acceptance needs a drafter"):
        resolve_mechanisms({"device-acceptance"}, Deployment("cuda", EngineConfig()))
    with pytest.raises(ValueError, match="unknown mechanism 'bogus'"):
        resolve_mechanisms({"bogus"}, here)


def test_mechanisms_change_the_defaults_with_plus_and_minus():
    assert parse_mechanisms("+budget, -early-launch") == {"+budget", "-early-launch"}
    with pytest.raises(ValueError, match="^--mechanisms: either names .* not both"):
        parse_mechanisms("+budget,early-launch")
    with pytest.raises(ValueError, match="^--mechanisms: unknown -bogus"):
        parse_mechanisms("+budget,-bogus")
    here = Deployment("cuda", DFLASH_TREES, DFLASH_CAPS, graphs=True)
    assert resolve_mechanisms({"+budget"}, here) == ALL | {"budget"}
    assert resolve_mechanisms({"-device-lookup"}, here) == ALL - {"device-lookup"}
    # what needs a mechanism left out goes with it; asked for, it is an error
    assert resolve_mechanisms({"-device-acceptance"}, here) == ALL - {"device-acceptance", "early-launch",
                                                                       "layout-ahead"}
    with pytest.raises(ValueError, match="--mechanisms: \\+early-launch needs device-acceptance, which is left out"):
        resolve_mechanisms({"-device-acceptance", "+early-launch"}, here)
    with pytest.raises(ValueError, match="--mechanisms: \\+layout-ahead needs CUDA graphs"):
        resolve_mechanisms({"+layout-ahead"}, replace(here, graphs=False))
    changed = replace(DFLASH_TREES, mechanisms=frozenset({"-device-lookup", "+b12"}))
    assert not changed.leaves_open("device-lookup") and changed.leaves_open("early-launch")
    assert changed.asks_for("b12") and not changed.asks_for("budget")
    assert DFLASH_TREES.leaves_open("device-lookup") and not DFLASH_TREES.asks_for("b12")
    exact = replace(DFLASH_TREES, mechanisms=frozenset({"b12"}))
    assert exact.asks_for("b12") and not exact.leaves_open("device-lookup")


def test_b12_is_asked_for_and_needs_bf16():
    bf16 = Deployment("cpu", EngineConfig(dtype="bfloat16"))
    assert "b12" not in resolve_mechanisms(None, replace(bf16, device="cuda", config=EngineConfig()))
    assert resolve_mechanisms({"b12"}, bf16) == {"b12"}
    assert resolve_mechanisms({"b12"}, Deployment("cuda", EngineConfig())) == {"b12"}  # auto is bf16 there
    with pytest.raises(ValueError, match=r"--mechanisms: b12 needs bf16 weights \(--dtype bfloat16\), not "
                                         r"torch.float32"):
        resolve_mechanisms({"b12"}, Deployment("cpu", EngineConfig()))


@pytest.mark.parametrize("changes,error", [
    ({"speculative_algorithm": "pard", "speculative_eagle_topk": 2},
     r"--speculative-eagle-topk \(tree-topk\) needs --speculative-algorithm dflash"),
    ({"speculative_algorithm": "ngram", "speculative_ngram_assist": 2},
     r"--speculative-ngram-assist \(ngram-assist\) needs a model drafter \(dflash or pard\), not ngram"),
    ({"speculative_ngram_assist": 1}, r"--speculative-ngram-assist \(ngram-assist\) needs a model drafter"),
    ({"speculative_algorithm": "dflash", "speculative_lookup_prob": 0.5},
     r"--speculative-lookup-prob \(lookup-prob\) needs draft trees"),
    ({"speculative_algorithm": "dflash", "speculative_eagle_topk": 0},
     r"--speculative-eagle-topk \(tree-topk\) must be"),
    ({"speculative_algorithm": "dflash", "speculative_ngram_assist": 5}, r"ngram-assist\) must be .*, got 5"),
    ({"speculative_lookup_prob": 0.0}, r"--speculative-lookup-prob \(lookup-prob\) must be a probability"),
    ({"attention_kv_splits": -1}, r"--attention-kv-splits \(kv-splits\) must be"),
    ({"cuda_graph_batch_sizes": ()}, r"--cuda-graph-bs \(graph-batch-sizes\) must be a list"),
    ({"cuda_graphs": 1}, r"--disable-cuda-graph \(cuda-graphs\) must be true or false"),
    ({"min_prefill_batch": 0}, r"--min-prefill-batch \(prefill-waves\) must be"),
])
def test_check_tunables_errors_name_the_flag(changes, error):
    with pytest.raises(ValueError, match=error):
        check_tunables(Deployment("cpu", EngineConfig(**changes)))


def test_check_tunables_accepts_what_applies():
    check_tunables(Deployment("cpu", EngineConfig()))
    check_tunables(Deployment("cuda", replace(DFLASH_TREES, speculative_lookup_prob=0.5, attention_kv_splits=4,
                                              cuda_graph_batch_sizes=(1, 2), min_prefill_batch=4)))
    check_tunables(Deployment("cpu", EngineConfig(speculative_algorithm="pard", speculative_ngram_assist=3)))


def test_ar_changes_leave_a_config_check_tunables_accepts():
    spec = replace(DFLASH_TREES, speculative_lookup_prob=0.5, attention_kv_splits=4, mechanisms=ALL)
    ar = replace(spec, **ar_changes(spec))
    check_tunables(Deployment("cuda", ar))
    assert ar.speculative_algorithm is None and ar.mechanisms == frozenset()
    assert (ar.speculative_eagle_topk, ar.speculative_ngram_assist, ar.speculative_lookup_prob) == (1, 0, 0.9)
    assert ar.attention_kv_splits == 4  # applies without a drafter too


def write_profile(tmp_path, profile: object) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return str(path)


def test_profile_load_and_apply(tmp_path):
    path = write_profile(tmp_path, {"mechanisms": ["device-acceptance"],
                                    "tunables": {"tree-topk": 2, "graph-batch-sizes": [1, 2, 4], "kv-splits": 3}})
    config = Profile.load(path).apply(EngineConfig(speculative_algorithm="dflash"))
    assert config.mechanisms == {"device-acceptance"} and config.speculative_eagle_topk == 2
    assert config.cuda_graph_batch_sizes == (1, 2, 4) and config.attention_kv_splits == 3
    assert Profile.load(write_profile(tmp_path, {"mechanisms": "stock"})).apply(EngineConfig()).mechanisms == set()
    assert Profile.load(write_profile(tmp_path, {"mechanisms": []})).mechanisms == frozenset()
    assert Profile.load(write_profile(tmp_path, {})).apply(EngineConfig()) == EngineConfig()


@pytest.mark.parametrize("profile,error", [
    ({"tunables": {"tree-topk": 2, "bogus": 1}}, "unknown tunables bogus"),
    ({"tunable": {}}, "expected an object with keys mechanisms and tunables"),
    ([], "expected an object"),
    ({"tunables": [1]}, r"tunables \(an object of name: value\)"),
    ({"tunables": {"kv-splits": -1}}, "kv-splits must be 0"),
    ({"mechanisms": ["bogus"]}, "mechanisms: unknown bogus"),
    ({"mechanisms": "all"}, "mechanisms must be a list of names or \"stock\""),
])
def test_profile_errors_name_the_file(tmp_path, profile, error):
    path = write_profile(tmp_path, profile)
    with pytest.raises(ValueError, match=f"^--profile {path}: .*{error}"):
        Profile.load(path)


def test_profile_missing_or_not_json(tmp_path):
    with pytest.raises(ValueError, match="--profile"):
        Profile.load(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="--profile .*bad.json"):
        Profile.load(tmp_path / "bad.json")


def test_in_effect_lists_sorted_mechanisms_and_every_tunable():
    report = in_effect(EngineConfig(cuda_graph_batch_sizes=(1, 2)), {"layout-ahead", "device-acceptance"})
    assert report["mechanisms"] == ["device-acceptance", "layout-ahead"]
    assert list(report["tunables"]) == [t.name for t in TUNABLES]
    assert report["tunables"]["graph-batch-sizes"] == [1, 2]
    json.dumps(report)


def config_from(*argv: str) -> EngineConfig:
    return engine_config_from_args(build_parser().parse_args(["serve", "--device", "cpu", *argv]))


def test_cli_flags_set_every_tunable():
    config = config_from("--speculative-algorithm", "dflash", "--speculative-eagle-topk", "3",
                         "--speculative-lookup-prob", "0.5", "--cuda-graph-bs", "1", "2", "8",
                         "--attention-kv-splits", "4", "--min-prefill-batch", "6", "--max-prefill-tokens", "512",
                         "--prefill-graph-tokens", "1024", "--disable-cuda-graph", "--mechanisms", "device-acceptance")
    assert (config.speculative_eagle_topk, config.speculative_ngram_assist) == (3, 2)  # assist: the CPU default
    assert config.speculative_lookup_prob == 0.5 and config.cuda_graph_batch_sizes == (1, 2, 8)
    assert (config.attention_kv_splits, config.min_prefill_batch, config.max_prefill_tokens) == (4, 6, 512)
    assert config.prefill_graph_tokens == 1024
    assert config.cuda_graphs is False and config.mechanisms == {"device-acceptance"}
    open_ = config_from()
    assert open_.cuda_graphs is True and open_.mechanisms is None
    assert open_.cuda_graph_batch_sizes == EngineConfig.cuda_graph_batch_sizes
    assert config_from("--mechanisms", "stock").mechanisms == frozenset()
    assert config_from("--mechanisms", "+budget").mechanisms == {"+budget"}


def test_cli_profile_under_the_flags_given(tmp_path):
    path = write_profile(tmp_path, {"mechanisms": ["device-acceptance", "early-launch"],
                                    "tunables": {"tree-topk": 4, "ngram-assist": 0, "kv-splits": 2,
                                                 "cuda-graphs": False, "max-running-requests": 3}})
    config = config_from("--speculative-algorithm", "dflash", "--profile", path)
    assert (config.speculative_eagle_topk, config.speculative_ngram_assist, config.attention_kv_splits) == (4, 0, 2)
    assert config.cuda_graphs is False and config.max_running_requests == 3
    assert config.mechanisms == {"device-acceptance", "early-launch"}
    config = config_from("--speculative-algorithm", "dflash", "--profile", path, "--speculative-eagle-topk", "2",
                         "--attention-kv-splits", "0", "--mechanisms", "stock", "--max-running-requests", "5")
    assert (config.speculative_eagle_topk, config.attention_kv_splits, config.max_running_requests) == (2, 0, 5)
    assert config.mechanisms == frozenset() and config.speculative_ngram_assist == 0


@pytest.mark.parametrize("argv,error", [
    (["--mechanisms", "bogus"], "--mechanisms: unknown bogus"),
    (["--profile", "/nonexistent/profile.json"], "--profile /nonexistent/profile.json"),
    (["--speculative-algorithm", "ngram", "--speculative-lookup-prob", "0.5"],
     r"--speculative-lookup-prob \(lookup-prob\) needs --speculative-algorithm dflash"),
    (["--speculative-algorithm", "ngram", "--mechanisms", "device-acceptance,layout-ahead"],
     "--mechanisms: layout-ahead needs CUDA graphs"),
    (["--mechanisms", "device-acceptance"], "--mechanisms: device-acceptance needs a drafter"),
    (["--cuda-graph-bs", "0"], "--cuda-graph-bs"),
])
def test_cli_errors_name_the_flag(capsys, tiny_dir, argv, error):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model-path", str(tiny_dir), "--device", "cpu", "--max-new-tokens", "2", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(error, err), err


def test_registry_command_lists_every_entry(capsys):
    assert main(["registry", "--device", "cpu", "--speculative-algorithm", "dflash", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in listing["tunables"]] == [t.name for t in TUNABLES]
    assert [m["name"] for m in listing["mechanisms"]] == [m.name for m in MECHANISMS]
    by_name = {t["name"]: t for t in listing["tunables"]}
    assert by_name["ngram-assist"]["default"] == 2 and by_name["tree-topk"]["default"] == 1  # dflash on CPU
    assert by_name["graph-batch-sizes"]["flag"] == "--cuda-graph-bs"
    assert main(["registry", "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert all(m.name in table for m in MECHANISMS) and "block-size" in table


def test_force_runs_its_reference_without_the_drafters_tunables(capsys, tiny_dir, tmp_path):
    """DFlash's open defaults turn n-gram assist on; the AR reference run must leave it (and any other
    drafter-only tunable) at its default, or check_tunables refuses it."""
    dflash = write_random_dflash(tmp_path, hidden=64, num_target_layers=2, mask_token_id=319)
    assert main(["force", "--model-path", str(tiny_dir), "--device", "cpu", "--speculative-algorithm", "dflash",
                 "--speculative-draft-model-path", str(dflash), "--dataset", "math", "--num-prompts", "2",
                 "--max-new-tokens", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


def test_engine_mechanisms_in_effect(tiny_dir):
    base = EngineConfig(model_path=str(tiny_dir), device="cpu", max_running_requests=2, context_length=64)
    assert Engine.from_config(base).mechanisms == frozenset()
    ngram = replace(base, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    assert Engine.from_config(replace(ngram, mechanisms=frozenset())).mechanisms == frozenset()
    # no graphs on CPU: device acceptance holds, the layout ahead does not
    assert Engine.from_config(ngram).mechanisms == {"device-acceptance"}


@pytest.fixture(scope="module")
def stock_server(tiny_dir):
    yield from serve(tiny_dir, max_running_requests=2, context_length=256, speculative_algorithm="ngram",
                     speculative_num_draft_tokens=4, attention_kv_splits=2, mechanisms=frozenset())


def test_server_info_reports_the_speed_settings(stock_server):
    speed = stock_server.info()["speed"]
    assert speed["mechanisms"] == []
    assert list(speed["tunables"]) == [t.name for t in TUNABLES]
    assert (speed["tunables"]["block-size"], speed["tunables"]["kv-splits"]) == (4, 2)
    assert speed["tunables"]["max-running-requests"] == 2
    assert speed == in_effect(stock_server.ctx.engine.config, stock_server.ctx.engine.mechanisms)


def test_shipped_profiles_by_name_and_the_embedded_models_default(monkeypatch, tmp_path):
    from specpilot.engine import registry

    assert "embedded-cuda" in shipped_profiles()
    assert Profile.load("embedded-cuda").tunables == {"tree-topk": 4, "ngram-assist": 3}
    with pytest.raises(ValueError, match=r"--profile embedded-tpu: no such file, nor a shipped profile \(embedded-cuda"):
        Profile.load("embedded-tpu")
    monkeypatch.setattr(registry, "embedded_profile", lambda device: "embedded-cuda")  # as a GPU would have it

    def config(command: str, *argv: str, **kw) -> EngineConfig:
        return engine_config_from_args(build_parser().parse_args([command, "--device", "cpu", *argv]), 1, **kw)

    # serve and generate on the embedded model: its DFlash drafter, in the shipped profile; flags win over it
    default = config("generate", speculate=True)
    assert default.speculative_algorithm == "dflash"
    assert (default.speculative_eagle_topk, default.speculative_ngram_assist) == (4, 3)
    assert config("serve", "--speculative-ngram-assist", "1", speculate=True).speculative_ngram_assist == 1
    assert config("generate", "--speculative-algorithm", "none", speculate=True).speculative_algorithm is None
    other = write_profile(tmp_path, {"tunables": {"ngram-assist": 0}})
    assert config("serve", "--profile", other, speculate=True).speculative_ngram_assist == 0
    # another model, or a command that does not speculate by default: as asked
    assert config("generate", "--model-path", str(tmp_path), speculate=True).speculative_algorithm is None
    assert config("bench").speculative_algorithm is None
    # optimize starts from the registry's defaults, not from a shipped profile
    assert config("serve", "--speculative-algorithm", "dflash", shipped=False).speculative_ngram_assist == 2
