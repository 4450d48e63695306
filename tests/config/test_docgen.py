from apr.config.docgen import render_markdown, render_schema
from apr.config.schema import AprConfig


def test_config_reference_is_current(repo):
    assert (repo / "docs/config.md").read_text() == render_markdown(), "run: python -m apr.config.docgen"
    assert (repo / "docs/config.schema.json").read_text() == render_schema(), "run: python -m apr.config.docgen"


def test_reference_documents_every_key(repo):
    text = render_markdown()

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert f"`{prefix}{name}`" in text, f"{prefix}{name} missing from docs/config.md"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, AprConfig.__mro__[1]):
                walk(ann, f"{prefix}{name}.")

    walk(AprConfig)
