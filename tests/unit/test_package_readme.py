"""The package index's page (pyproject's readme, docs/package-readme.md) is written for someone who
installed the wheel: the commands they have, and links that work outside a checkout."""

import re
import tomllib

from tests.helpers import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
README = REPO / PYPROJECT["project"]["readme"]["file"]
HOME = PYPROJECT["project"]["urls"]["Source"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_package_readme_is_its_own_markdown_file():
    assert PYPROJECT["project"]["readme"]["content-type"] == "text/markdown"
    assert README != REPO / "README.md" and README.is_file()


def test_every_link_is_absolute_and_every_link_home_names_a_file_of_the_repository():
    links = LINK.findall(README.read_text())
    assert len(links) >= 10
    assert [link for link in links if not link.startswith("https://")] == []
    for link in links:
        if link.startswith(HOME + "/blob/main/"):
            path = link.removeprefix(HOME + "/blob/main/").split("#")[0]
            assert (REPO / path).is_file(), link


def test_every_project_url_is_under_the_one_home():
    urls = PYPROJECT["project"]["urls"]
    assert {"Homepage", "Documentation", "Source", "Changelog"} <= set(urls)
    assert all(url.startswith(HOME) for url in urls.values())


def test_it_names_only_what_a_wheel_user_has():
    text = README.read_text()
    assert "train.py" not in text and "make " not in text and "benchmarks/" not in text
    commands = [line.split("#")[0].split() for line in text.splitlines()
                if line.startswith("gpu-practice-train")]
    assert len(commands) >= 10
    assert {"scaffold", "deploy"} <= {words[1] for words in commands if len(words) > 1}
