"""Recipe lineage: the parent named in a recipe's defaults, and the command line with it swapped in."""

from __future__ import annotations

from trainer.configuration.recipes import differences, parent_of, recipe_file, with_recipe


def test_parents_follow_the_ladder_and_the_top_recipes_have_none():
    assert parent_of("resnet50_baseline") == "resnet50_optimized"
    assert parent_of("resnet50_data") == "resnet50_baseline"
    assert parent_of("resnet50_amp") == "resnet50_data"
    assert parent_of("resnet50_channels_last") == "resnet50_amp"
    assert parent_of("resnet50_compile") == "resnet50_channels_last"
    assert parent_of("resnet50_optimized") is None
    assert parent_of("digits_quickstart") is None
    assert parent_of("no_such_recipe") is None


def test_a_team_folder_on_the_search_path_is_searched_after_ours(tmp_path):
    (tmp_path / "ours.yaml").write_text("# @package _global_\ndefaults:\n  - resnet50_amp\n  - _self_\n")
    path = [f"recipes://{tmp_path}"]
    assert recipe_file("ours", path) == tmp_path / "ours.yaml"
    assert parent_of("ours", path) == "resnet50_amp"
    assert recipe_file("ours") is None


def test_with_recipe_swaps_the_recipe_whatever_its_prefix():
    assert with_recipe(["+recipe=a", "data=synthetic"], "b") == ["data=synthetic", "+recipe=b"]
    assert with_recipe(["++recipe=a", "x=1"], "b") == ["x=1", "+recipe=b"]
    assert with_recipe(["recipe_note=1"], "b") == ["recipe_note=1", "+recipe=b"]


def test_differences_name_changed_added_and_removed_keys():
    before = {"a": {"b": 1, "c": [1, 2]}, "gone": 1}
    after = {"a": {"b": 2, "c": [1, 2]}, "new": {"x": True}}
    assert differences(before, after) == {"a.b": [1, 2], "gone": [1, None], "new.x": [None, True]}
