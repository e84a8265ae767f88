"""Steering refuses bad input with a code, before any forward pass (plan() refuses the same), or, where a run
overflows, names the coefficient that made it; the command line has `entoscope steer`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.cli import main
from entoscope.errors import EntoscopeError

DATA = {"task": "ioi", "n": 3, "seed": 1}


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


class _Counting:
    """Counts the forward passes the model makes (a refusal before any work makes none)."""

    def __init__(self, model):
        self.n = 0
        block = model.blocks[0]  # every forward calls the first block (the bridge's own __call__ is not hooked)
        self.handle = block.register_forward_pre_hook(lambda *_: setattr(self, "n", self.n + 1))

    def close(self):
        self.handle.remove()


def _refused(demo, code, **config):
    count = _Counting(demo)
    try:
        with pytest.raises(EntoscopeError) as err:
            es.Steering(**{"side_effects": None, **config}).plan(demo, config.pop("data", DATA))
        assert err.value.code == code, err.value
        with pytest.raises(EntoscopeError) as err:
            es.Steering(**{"side_effects": None, **config}).run(demo, DATA, quiet=True)
        assert err.value.code == code, err.value
        assert count.n == 0  # nothing ran
    finally:
        count.close()
    return err.value


def _v(width=128, value=1.0):
    return torch.full((width,), value)


def test_a_direction_of_the_wrong_width_is_refused(demo):
    err = _refused(demo, "direction_width", direction=es.Direction("resid_pre.1", _v(64)))
    assert "64" in err.message and "128" in err.message
    _refused(demo, "direction_width", direction=es.Direction("resid_pre.1", _v()), at="mlp_post.0")
    _refused(demo, "direction_width", direction={"source": "vector", "site": "mlp_pre.0", "values": [1.0] * 128})


def test_a_site_that_cannot_be_written_is_refused(demo):
    _refused(demo, "site_not_writable", direction={"source": "vector", "site": "logits", "values": [1.0] * 1317})
    _refused(demo, "steering_site_kind", direction={"source": "vector", "site": "pattern.0", "values": [1.0] * 4})
    _refused(demo, "steering_head", direction=es.Direction("z.0", _v(32)))
    _refused(demo, "site_out_of_range", direction=es.Direction("z.0", _v(32), head=9))
    _refused(demo, "site_out_of_range", direction=es.Direction("resid_pre.7", _v()))
    _refused(demo, "direction_width", direction=es.Direction("pos_embed", _v(5)))


def test_nan_zero_and_unreadable_vectors_are_refused(demo, tmp_path):
    with pytest.raises(EntoscopeError) as err:
        es.Direction("resid_pre.1", torch.tensor([1.0, float("nan"), 2.0]))
    assert err.value.code == "direction_non_finite" and "[1]" in err.value.message
    with pytest.raises(EntoscopeError) as err:
        es.Direction("resid_pre.1", torch.zeros(128))
    assert err.value.code == "direction_zero"
    with pytest.raises(EntoscopeError) as err:
        es.Steering(direction={"source": "vector", "site": "resid_pre.1", "values": [float("nan")] * 128})
    assert err.value.code == "config_invalid"
    bad = np.ones(128)
    bad[3] = np.inf
    np.save(tmp_path / "inf.npy", bad)
    np.save(tmp_path / "two.npy", np.ones((2, 128)))
    np.save(tmp_path / "zero.npy", np.zeros(128))
    (tmp_path / "v.txt").write_text("1 2 3")
    from safetensors.numpy import save_file

    save_file({"a": np.ones(128, np.float32), "b": np.ones(128, np.float32)}, str(tmp_path / "two.safetensors"))
    for path, code in (("inf.npy", "direction_non_finite"), ("two.npy", "direction_shape"),
                       ("zero.npy", "direction_zero"), ("v.txt", "direction_file_format"),
                       ("missing.npy", "direction_file_missing"), ("two.safetensors", "direction_file_key")):
        _refused(demo, code, direction={"source": "file", "path": str(tmp_path / path), "site": "resid_pre.1"})
    (tmp_path / "garbage.npy").write_bytes(b"not an array")
    _refused(demo, "direction_file_format", direction={"source": "file", "path": str(tmp_path / "garbage.npy"),
                                                        "site": "resid_pre.1"})
    whole = (tmp_path / "two.safetensors").read_bytes()  # cut short: the data its header promises is missing
    (tmp_path / "cut.safetensors").write_bytes(whole[: len(whole) - 100])
    _refused(demo, "direction_file_format", direction={"source": "file", "path": str(tmp_path / "cut.safetensors"),
                                                        "key": "a", "site": "resid_pre.1"})


def test_coefficients_that_overflow_are_refused_naming_the_coefficient(demo):
    err = _refused(demo, "steering_coefficient_overflow", direction=es.Direction("resid_pre.1", _v()),
                   coefficients=[1.0, 1e19])
    assert "1e+19" in err.message
    _refused(demo, "steering_coefficients", direction=es.Direction("resid_pre.1", _v()), coefficients=[])
    _refused(demo, "steering_coefficients", direction=es.Direction("resid_pre.1", _v()), coefficients=[1.0, 1.0])


def test_a_run_made_non_finite_by_a_coefficient_is_refused_naming_it(demo):
    # set the first norm's scale to 0 (coefficient 0 under set): the norm divides by zero
    op = es.Steering(direction=es.Direction("ln1_scale.1", torch.tensor([1.0])), mode="set", coefficients=[1.0, 0.0],
                     side_effects=None)
    with pytest.raises(EntoscopeError) as err:
        op.run(demo, DATA, quiet=True)
    assert err.value.code == "steering_non_finite"
    assert "coefficient 0 (the direction)" in err.value.message


def test_positions_and_direction_data_are_checked(demo):
    d = es.Direction("resid_pre.1", _v())
    _refused(demo, "role_unknown", direction=d, positions=["YY"])
    _refused(demo, "steering_positions", direction=d, positions=[])
    _refused(demo, "steering_positions", direction=d, positions="last:0")
    _refused(demo, "steering_positions", direction=d, positions=[40])
    _refused(demo, "data_no_counterfactuals", direction={"source": "mean_difference", "site": "resid_pre.1",
                                                          "data": {"prompts": ["a b", "c d"]}})
    _refused(demo, "direction_pca_needs_pairs", direction={"source": "mean_difference", "site": "resid_pre.1",
                                                            "data": {"task": "ioi", "n": 2}, "pca": True,
                                                            "negative": {"task": "facts", "n": 2}})
    with pytest.raises(EntoscopeError) as err:
        es.Steering(direction=d, side_effects=None).plan(demo, {"prompts": ["no answers here"]})
    assert err.value.code == "data_no_answers"
    with pytest.raises(EntoscopeError) as err:
        es.Steering(direction=d, side_effects={"tasks": ["ioi", "nope"]}).plan(demo, DATA)
    assert err.value.code == "unknown_task"
    with pytest.raises(EntoscopeError) as err:
        es.Steering(direction={"source": "probe", "site": "resid_pre.1"})
    assert err.value.code == "config_invalid" and "path" in err.value.message


def test_the_command_line_steers_and_refuses_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["steer", "--help"])
    assert done.value.code == 0
    assert "--coefficients" in capsys.readouterr().out
    code = main(["steer", "--model", "demo", "--data", "{task: greater_than, n: 4, seed: 7}", "--direction",
                 "{source: mean_difference, site: resid_pre.2, data: {task: greater_than, n: 8, seed: 100}}",
                 "--coefficients", "[-0.5, 0.5]", "--metric", "prob_diff", "--side-effects", "{tasks: [ioi], n: 4}",
                 "--out", str(tmp_path / "run"), "--quiet"])
    assert code == 0 and (tmp_path / "run" / "direction.safetensors").exists()
    capsys.readouterr()
    code = main(["steer", "--model", "demo", "--data", "ioi", "--direction",
                 "{source: vector, site: resid_pre.1, values: [1.0, 2.0]}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "[direction_width]" in err
