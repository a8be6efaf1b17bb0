"""The manual stays a manual: no dated notes, links that resolve, a generated reference that is current, and a
`--help` that lists every field of the config."""

from __future__ import annotations

import re

import pytest

from hybrid_rl import config_doc
from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
DATE = re.compile(r"\b(19|20)\d\d-[01]\d(-[0-3]\d)?\b")
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_dates_and_every_link_resolves(page):
    text = page.read_text()
    dated = [m.group(0) for m in DATE.finditer(text)]
    assert not dated, f"{page.name} carries dates {dated}: history goes in CHANGELOG.md, stories in benchmarks/results/"
    for target, _ in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"


def test_generated_reference_is_current():
    ref = REPO / "docs" / "reference.md"
    assert ref.read_text() == config_doc.reference_markdown(), \
        "docs/reference.md is out of date: python -m hybrid_rl.config_doc > docs/reference.md"


def test_every_field_is_documented_and_listed_by_help():
    fields = config_doc.describe()
    assert len(fields) > 100
    undocumented = [f.key for f in fields if not f.doc]
    assert not undocumented, f"fields without a doc comment in config.py: {undocumented}"
    for group in config_doc.groups():
        text = config_doc.help_text(group)
        for f in fields:
            if f.key.startswith(group + "."):
                assert f"{f.key} (" in text


def test_help_of_the_entry_point_and_a_bad_group(capsys):
    from hybrid_rl.train import main

    with pytest.raises(SystemExit) as done:
        main(["--help", "algorithm"])
    out = capsys.readouterr()
    assert done.value.code == 0 and "algorithm.advantage (str, default 'grpo')" in out.out, out.err
    assert main(["--help", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "no such group" in err
