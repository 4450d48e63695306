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


def test_optional_sections_render_as_objects_and_lists_as_lists():
    text = render_markdown()
    for single in ("model.lora", "model.stacking", "training.distill", "evaluation.samples"):
        assert f"## `{single}`\n" in text and f"`{single}[]" not in text, single
        assert f"| `{single}.` " not in text  # rows name their keys, e.g. model.lora.rank
    assert "| `model.lora.rank` |" in text
    for listed in ("monitoring.alerts", "monitoring.sinks", "model.stacking.stages", "data.train", "data.stages"):
        assert f"## `{listed}[]`\n" in text, listed


def test_section_descriptions_are_whole_paragraphs():
    """A class docstring's first paragraph is rendered whole, never its first line only."""
    import inspect

    from pydantic import BaseModel

    text = render_markdown()
    seen = set()

    def walk(model):
        for field in model.model_fields.values():
            for ann in (field.annotation, *__import__("typing").get_args(field.annotation)):
                for cls in (ann, *__import__("typing").get_args(ann)):
                    if isinstance(cls, type) and issubclass(cls, BaseModel) and cls not in seen:
                        seen.add(cls)
                        walk(cls)

    walk(AprConfig)
    for cls in seen:
        doc = inspect.cleandoc(cls.__doc__ or "")
        if doc:
            paragraph = " ".join(doc.split("\n\n")[0].split())
            assert paragraph in text, f"{cls.__name__}: {paragraph!r} not rendered whole"
    assert "(docs/training.md \"Spike rollback\")." in text
