"""A team's own folder (trainer/configuration/recipes.py, trainer/scaffold.py): found from the working
directory or TRAINER_TEAM_DIRS without absolute paths in any config, never the shipped folders a
checkout shows at its top; the scaffold writes a complete starter folder and refuses to overwrite."""

from __future__ import annotations

import pytest

from trainer.configuration.recipes import CONF_DIR, RECIPES_DIR, team_folders, team_search_path
from trainer.infra.errors import UserError
from trainer.scaffold import scaffold
from tests.helpers import REPO


def test_the_working_directory_and_the_variable_name_team_folders(tmp_path):
    here, other, plain = tmp_path / "here", tmp_path / "other", tmp_path / "plain"
    (here / "recipes").mkdir(parents=True)
    (other / "conf" / "model").mkdir(parents=True)
    plain.mkdir()
    assert team_folders(here, {}) == [here]
    assert team_folders(plain, {"TRAINER_TEAM_DIRS": f"{other}:{here}:{plain}"}) == [other, here]
    assert team_search_path([here, other]) == [f"recipes://{here / 'recipes'}", f"file://{other / 'conf'}"]


def test_a_checkout_is_not_a_team_folder():
    # Its conf/ and recipes/ are links to the shipped folders, already on the search path.
    assert (REPO / "conf").resolve() == CONF_DIR and (REPO / "recipes").resolve() == RECIPES_DIR
    assert team_folders(REPO, {}) == []


def test_the_scaffold_writes_a_recipe_groups_code_and_a_test(tmp_path):
    written = scaffold(tmp_path / "vision-team")
    names = sorted(str(path.relative_to(tmp_path / "vision-team")) for path in written)
    assert names == ["README.md", "conf/data/vision_team_digits.yaml", "conf/model/vision_team_net.yaml",
                     "recipes/vision_team_digits.yaml", "tests/test_recipes.py", "vision_team/__init__.py",
                     "vision_team/data.py", "vision_team/models.py"]
    recipe = (tmp_path / "vision-team" / "recipes" / "vision_team_digits.yaml").read_text()
    assert "- digits_quickstart" in recipe and "override /model: vision_team_net" in recipe
    compile("".join(path.read_text() for path in written if path.suffix == ".py"), "scaffold", "exec")


def test_the_scaffold_refuses_a_folder_in_use_and_a_bad_package_name(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="is not empty"):
        scaffold(tmp_path / "used")
    with pytest.raises(UserError, match="not a Python package name"):
        scaffold(tmp_path / "new", package="Our-Team")
    assert (tmp_path / "used" / "notes.txt").read_text() == "keep me"
