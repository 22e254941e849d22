"""Config loading errors name the field; CLI errors name parameter, range and value with exit code 2."""
import json

import pytest
import yaml

from cluster.cli.main import main
from cluster.config.schema import config_from_dict, load_config
from cluster.errors import ConfigError


def _tiny():
    return yaml.safe_load(open("configs/tiny.yaml"))


def test_shipped_configs_load():
    assert load_config("configs/tiny.yaml").drafters == ["drafter-large", "drafter-small"]
    local = load_config("configs/local.yaml")
    assert local.models["target"].zoo == "target" and local.engine.options["drafter"] == "drafter-large"


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d["models"]["target"].update(path="/x"), "models.target: give exactly one of zoo, path, tiny"),
    (lambda d: d["models"]["target"].update(colour="red"), "models.target.colour: unknown field"),
    (lambda d: d["models"]["target"]["tiny"].update(layers="four"), "models.target.tiny.layers: expected int"),
    (lambda d: d["models"]["target"]["tiny"].update(hidden=30), "models.target.tiny.hidden: must be divisible"),
    (lambda d: d.update(target="nope"), "target: 'nope' is not one of models"),
    (lambda d: d["engine"].update(strategy="magic"), "engine.strategy: one of"),
    (lambda d: d["engine"]["options"].update(k=0), "engine.options.k: invalid k: 0 (allowed: integer in [1, 64])"),
    (lambda d: d["engine"]["options"].update(bogus=1), "engine.options.bogus: unknown option"),
    (lambda d: d["engine"]["options"].update(drafter="target"), "engine.options.drafter"),
    (lambda d: d["generation"].update(temperature=-1), "generation.temperature"),
    (lambda d: d["generation"].update(max_new_tokens=0), "generation.max_new_tokens: must be >= 1"),
    (lambda d: d.update(models=[1, 2]), "models: expected a mapping"),
    (lambda d: d["engine"].update(max_batch=0), "engine.max_batch: must be in [1, 4096], got 0"),
    (lambda d: d["engine"].update(max_queue=-1), "engine.max_queue: must be in [0, 1048576], got -1"),
    (lambda d: d["engine"].update(kv_budget_tokens=0), "engine.kv_budget_tokens: must be >= 1"),
    (lambda d: d["engine"]["options"].update(verify="sometimes"), "engine.options.verify"),
])
def test_bad_config_names_the_field(mutate, needle):
    data = _tiny()
    mutate(data)
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert needle in str(e.value)


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("models: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


BASE = ("generate", "--config", "configs/tiny.yaml", "--prompt", "def f(")


@pytest.mark.parametrize("extra,needle", [
    (("--k", "0"), "invalid k: 0 (allowed: integer in [1, 64])"),
    (("--k", "two"), "invalid k: 'two' (allowed: integer in [1, 64])"),
    (("--temperature", "-1"), "invalid temperature: '-1' (allowed: number in [0.0, 100.0])"),
    (("--top-p", "0"), "invalid top_p: '0' (allowed: number in (0.0, 1.0])"),
    (("--top-k", "-3"), "invalid top_k: -3 (allowed: integer >= 0)"),
    (("--max-new-tokens", "100000"), "invalid max_new_tokens: 100000 (allowed: integer in [1, 512])"),
    (("--strategy", "nope"), "invalid strategy: 'nope' (allowed: one of"),
    (("--verify", "nope"), "invalid verify: 'nope' (allowed: one of token"),
    (("--drafter", "target"), "invalid drafter: 'target' (allowed: one of drafter-large, drafter-small)"),
    (("--seed", "-4"), "invalid seed"),
])
def test_cli_errors_are_one_line_with_exit_2(capsys, extra, needle):
    rc, out, err = _run(capsys, *BASE, *extra)
    assert rc == 2 and out == ""
    assert err.startswith("specserve: error: ") and needle in err and err.count("\n") == 1


def test_cli_bad_config_exit_2(capsys, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("models: {target: {zoo: target, path: /x}}\n")
    rc, _, err = _run(capsys, "generate", "--config", str(p), "--prompt", "x")
    assert rc == 2 and "models.target: give exactly one of" in err


def test_cli_generate_json(capsys):
    rc, out, _ = _run(capsys, *BASE, "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "9",
                      "--json", "--strategy", "speculative", "--k", "3")
    data = json.loads(out)
    assert rc == 0 and len(data["token_ids"]) <= 12 and data["seed"] == 9
    assert data["stats"]["strategy"] == "speculative" and data["stats"]["target_forwards"] >= 1
    rc2, out2, _ = _run(capsys, *BASE, "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "9",
                        "--json", "--strategy", "speculative", "--k", "3")
    assert json.loads(out2)["token_ids"] == data["token_ids"]
