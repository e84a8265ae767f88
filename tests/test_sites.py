"""Sites: grids, filters, groups and coordinates resolve to the right units; bad ones are refused."""

import pytest

from entoscope.errors import SiteError
from entoscope.models import adapt
from entoscope.sites import Sites, absolute_positions

from conftest import get_tiny


@pytest.fixture(scope="module")
def gpt2():
    return adapt(get_tiny("gpt2", "bridge", False))


@pytest.fixture(scope="module")
def llama():
    return adapt(get_tiny("llama", "bridge", False))


def coords(siteset):
    return [tuple(dict(u.members[0]).items()) if not u.is_group else tuple(u.members) for u in siteset.units]


def test_grid_is_the_product_of_the_selections(gpt2):
    s = Sites(activation="resid_pre", over=["layer", "position"], positions=[0, -1]).resolve(gpt2, [6, 6])
    got = {(u.get("layer"), u.get("pos")) for u in s.units}
    assert got == {(L, p) for L in range(2) for p in (0, -1)} and len(s) == 4


def test_ranges_excludes_and_negative_indices(gpt2):
    s = Sites(activation="z", over=["layer", "head"], layers="-1:", heads="1:3",
              exclude=[{"layer": 1, "head": 2}]).resolve(gpt2)
    assert [(u.get("layer"), u.get("head")) for u in s.units] == [(1, 1)]
    s = Sites(activation="z", over=["layer", "head"], heads=-1).resolve(gpt2)
    assert {u.get("head") for u in s.units} == {3}


def test_groups_read_several_units_as_one_row(gpt2):
    s = Sites(activation="z", groups=[[{"layer": 1, "head": 0}, {"layer": 1, "head": 3}]]).resolve(gpt2)
    assert len(s) == 1 and s.units[0].is_group and s.units[0].label == "a1.h0+a1.h3"
    assert s.units[0].get("layer") == 1 and s.units[0].get("head") is None


def test_explicit_coordinates(gpt2):
    s = Sites(activation="mlp_post", coords=[{"layer": 0, "neuron": 7}, {"layer": 1, "neuron": 255}]).resolve(gpt2)
    assert [(u.get("layer"), u.get("neuron")) for u in s.units] == [(0, 7), (1, 255)]


def test_a_layer_in_the_activation_name_fixes_the_layer(gpt2):
    s = Sites(activation="blocks.1.hook_resid_post", over=["position"], positions=[2]).resolve(gpt2, [5])
    assert [(u.get("layer"), u.get("pos")) for u in s.units] == [(1, 2)]


@pytest.mark.parametrize("bad, code", [
    (dict(activation="resid_pre", over=["layer", "neuron"]), "axis_not_in_activation"),
    (dict(activation="mlp_out", over=["layer", "head"]), "axis_not_in_activation"),
    (dict(activation="resid_pre", layers=[2]), "site_out_of_range"),
    (dict(activation="z", over=["layer", "head"], heads=[4]), "site_out_of_range"),
    (dict(activation="mlp_post", coords=[{"layer": 0, "neuron": 256}]), "site_out_of_range"),
    (dict(activation="z", over=["layer", "head"], heads=[], layers=[0]), "empty_selection"),
])
def test_refusals_name_the_problem_and_the_valid_range(gpt2, bad, code):
    with pytest.raises(SiteError) as err:
        Sites(**bad).resolve(gpt2, [6])
    assert err.value.code == code and err.value.remedy


def test_positions_are_checked_against_every_prompt(gpt2):
    with pytest.raises(SiteError) as err:
        Sites(activation="resid_pre", over=["layer", "position"], positions=[7]).resolve(gpt2, [9, 7])
    assert "prompt 1" in str(err.value) and "7 tokens" in str(err.value)
    # "all" on prompts of different lengths: the last 7 tokens of each, counted from its end
    s = Sites(activation="resid_pre", over=["position"], positions="all").resolve(gpt2, [9, 7])
    assert {u.get("pos") for u in s.units} == set(range(-7, 0)) and "last 7" in s.note
    assert list(s.frame()["position"]) == [f"END-{k}" for k in range(6, 0, -1)] + ["END"]


def test_kv_sites_under_grouped_query_attention(llama):
    assert len(Sites(activation="k", over=["layer", "kv_head"], layers=[0]).resolve(llama)) == 2
    assert len(Sites(activation="k", over=["layer", "head"], layers=[0]).resolve(llama)) == 4  # per query head


def test_absolute_positions():
    import torch

    lengths = torch.tensor([5, 8])
    assert absolute_positions(-1, lengths).tolist() == [4, 7]
    assert absolute_positions(2, lengths).tolist() == [2, 2]


def test_a_selection_on_an_axis_left_out_of_over_is_read_not_dropped(gpt2):
    """Issue 37: positions=[-1] without position in `over` used to read every position (the selection
    was dropped); each row now reads the selected indices of the axes it does not split over."""
    s = Sites(activation="resid_pre", over=["layer"], positions=[-1]).resolve(gpt2, [6, 7])
    assert [u.members for u in s.units] == [((("layer", L), ("pos", -1)),) for L in range(2)]
    s = Sites(activation="z", over=["layer"], heads=[0, 3], positions=[2]).resolve(gpt2, [6])
    assert [set(u.members) for u in s.units] == [{(("head", h), ("layer", L), ("pos", 2)) for h in (0, 3)}
                                                 for L in range(2)]
    s = Sites(activation="mlp_post", over=["position"], neurons="0:2", layers=[1]).resolve(gpt2, [6])
    assert len(s) == 6 and set(s.units[0].members) == {(("layer", 1), ("neuron", n), ("pos", 0)) for n in (0, 1)}
    # an exclusion reaches the members of the axes a row reads part of
    s = Sites(activation="z", over=["layer"], heads=[0, 3], exclude=[{"layer": 1, "head": 0}]).resolve(gpt2)
    assert [sorted(dict(m)["head"] for m in u.members) for u in s.units] == [[0, 3], [3]]


def test_a_feature_selection_without_a_feature_axis_reads_those_features():
    from entoscope.models import load_model

    m = adapt(load_model("demo"))
    s = Sites(activation="resid_post", dictionary="demo", over=["layer"], features=[3, 7]).resolve(m)
    assert all({dict(c)["feature"] for c in u.members} == {3, 7} for u in s.units) and len(s) > 1


@pytest.mark.parametrize("bad, code", [
    (dict(activation="resid_pre", over=["layer"], heads=[1]), "axis_not_in_activation"),
    (dict(activation="mlp_out", over=["layer"], neurons=[1]), "axis_not_in_activation"),
    (dict(activation="resid_post", over=["layer"], features=[1]), "axis_not_in_activation"),  # no dictionary
    (dict(activation="pattern", over=["layer"], positions=[1]), "axis_not_in_activation"),  # query/key positions
    (dict(activation="z", over=["layer"], exclude=[{"layer": 0, "head": 1}]), "bad_selection"),  # heads read whole
    (dict(activation="resid_pre", over=["layer"], exclude=[{"pos": 0}]), "bad_selection"),
    (dict(activation="blocks.1.hook_resid_pre", over=["position"], layers=[0]), "bad_selection"),
])
def test_a_selection_that_cannot_be_honoured_is_refused(gpt2, bad, code):
    with pytest.raises(SiteError) as err:
        Sites(**bad).resolve(gpt2, [6])
    assert err.value.code == code and err.value.remedy
