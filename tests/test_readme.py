"""The README is a guide a newcomer reads to the end: at most 200 lines, a GPU serving
command within the first 100 and the Ray recipe within the first 150, and every page,
image and path it links present."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text().splitlines()


def _first_line(pattern: str) -> int:
    return next(i + 1 for i, line in enumerate(README) if re.search(pattern, line))


def test_the_readme_is_at_most_200_lines():
    assert len(README) <= 200, f"README.md has {len(README)} lines: move detail to docs/"


def test_a_newcomer_reaches_the_gpu_server_and_the_ray_recipe_early():
    assert _first_line(r"^vllm serve \S+ --speculative-config graft\.json") <= 100
    assert _first_line(r"^ray start --head") <= 150
    assert _first_line(r"distributed-executor-backend ray") <= 150


def test_every_linked_page_and_image_exists():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", "\n".join(README))
    local = [link for link in links if not link.startswith("http")]
    assert local, "the README links no docs"
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, missing


def test_the_docs_link_only_pages_that_exist():
    for page in (REPO / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not link.startswith("http"):
                assert (page.parent / link).exists(), f"{page.name}: {link}"
