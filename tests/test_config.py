"""Config: defaults < YAML < --key=value, values read as a user means them."""
import pytest

from fsdp_gpt.config import TrainConfig, UserError
from fsdp_gpt.config_parse import parse_args
from conftest import DEMO


def test_overrides_read_as_meant_and_last_wins():
    cfg = parse_args([DEMO, "--learning_rate=3e-3", "--compile=true", "--fsdp_size=null", "--max_iters=5",
                      "--max_iters", "7", "--data_source=[a.txt, b/*.md]"])
    assert cfg.learning_rate == 3e-3 and isinstance(cfg.learning_rate, float)
    assert cfg.compile is True and cfg.fsdp_size is None and cfg.max_iters == 7
    assert cfg.data_source == ["a.txt", "b/*.md"]
    assert cfg.n_layer == 4  # from the YAML file
    assert cfg.beta2 == TrainConfig.beta2  # from the defaults


def test_yaml_scientific_notation_without_dot(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 3e-3\nmax_iters: 10\n")
    assert parse_args([str(path)]).learning_rate == 3e-3


@pytest.mark.parametrize("argv, message", [
    (["--lr=1"], "unknown config key 'lr'"),
    (["--n_layer=2.5"], "'n_layer'"),
    (["--bias=yes please"], "'bias'"),
    (["--micro_batch=3"], "micro_batch=3 must divide train_batch=32"),
    (["--dtype=fp8"], "dtype 'fp8'"),
    (["--checkpoint_type=zip"], "checkpoint_type"),
    (["stray"], "unexpected argument 'stray'"),
    (["--normuon=true"], "normuon and cautious_weight_decay change Muon's update: set optimizer: muon"),
])
def test_rejected(argv, message):
    with pytest.raises(UserError, match=message):
        parse_args([DEMO] + argv)


def test_every_key_has_a_meaning_and_help_lists_them_all():
    from fsdp_gpt import config
    from fsdp_gpt import config_help
    for f in config.FIELDS.values():
        assert len(f.metadata.get("meaning", "")) > 10, f"config key '{f.name}' has no meaning: give it one with key()"
    text = config_help.help_text()
    assert all(f"  --{name}=" in text for name in config.FIELDS)
    groups = config_help.grouped_keys()
    assert list(groups) == list(config_help.GROUPS.values())
    assert [f.name for fields in groups.values() for f in fields] == list(config.FIELDS)


def test_docs_config_page_is_the_generated_table():
    import os
    from fsdp_gpt import config_help
    from conftest import ROOT
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        page = f.read()
    assert config_help.keys_markdown() in page, ("docs/config.md differs from config.py: regenerate its tables with "
                                                 "python -m fsdp_gpt.doc_tables")
