"""Every link between the repository's Markdown files names a file that exists and, with a
#fragment, a heading in it (README's link to the "turn off Sokratos's own pipelines" step named
an anchor no heading had, on the warning that every memory would be written twice)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    p
    for p in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("bench/*.md")]
    if p.is_file()
)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text("utf-8"))
    found: set[str] = set()
    for heading in _HEADING.findall(text):
        slug, n = _slug(heading), 1
        while slug in found:  # GitHub numbers repeated headings: name, name-1, ...
            slug = f"{_slug(heading)}-{n}"
            n += 1
        found.add(slug)
    return found


def _links(path: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", path.read_text("utf-8")))


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_links_between_documents_resolve(doc: Path) -> None:
    broken = []
    for link in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        target, _, fragment = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link}: no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
            broken.append(f"{link}: no heading with anchor #{fragment} in {path.name}")
    assert not broken, "\n".join(broken)


def test_the_slugs_match_githubs() -> None:
    assert _slug("5. Turn off Sokratos's own triage, distillation and email checks") == (
        "5-turn-off-sokratoss-own-triage-distillation-and-email-checks"
    )
    assert _slug("3. Secrets: LoadCredential") == "3-secrets-loadcredential"
    assert _slug("10. The systemd watchdog, restarts and what `status` says") == (
        "10-the-systemd-watchdog-restarts-and-what-status-says"
    )
