"""docs/reference/config.md is generated from the schema: it must say what the code does."""

from pathlib import Path

from dflash_trainer.config_io import all_keys, reference_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_the_config_reference_is_the_schemas():
    doc = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert doc == reference_markdown(), "docs/reference/config.md is stale: run `make docs`"
    for key in all_keys():
        assert f"| `{key}` |" in doc
