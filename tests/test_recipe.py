"""recipe: Format dtypes, defaults (TE's), frozen + printable + validated recipes."""
import dataclasses

import pytest
import torch

from transformer_fp8 import recipe


def test_formats_give_forward_and_backward_dtypes():
    assert (recipe.Format.E4M3.fwd_dtype, recipe.Format.E4M3.bwd_dtype) == (torch.float8_e4m3fn,) * 2
    assert (recipe.Format.HYBRID.fwd_dtype, recipe.Format.HYBRID.bwd_dtype) == (torch.float8_e4m3fn,
                                                                               torch.float8_e5m2)


def test_delayed_scaling_defaults_follow_transformer_engine():
    r = recipe.DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.reduce_amax) == (
        0, recipe.Format.HYBRID, 1024, "max", True)
    assert recipe.Float8CurrentScaling().fp8_format is recipe.Format.HYBRID


def test_recipes_are_frozen_printable_and_hashable():
    r = recipe.DelayedScaling(margin=2, amax_history_len=16, amax_compute_algo="most_recent")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.margin = 1
    text = repr(r)
    assert "margin=2" in text and "amax_history_len=16" in text and "most_recent" in text and "HYBRID" in text
    assert r == recipe.DelayedScaling(margin=2, amax_history_len=16, amax_compute_algo="most_recent")
    assert len({r, recipe.DelayedScaling(margin=2, amax_history_len=16, amax_compute_algo="most_recent")}) == 1
    assert "E4M3" in repr(recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(margin=-1), ValueError, "margin"),
    (dict(margin="1"), ValueError, "margin"),
    (dict(fp8_format="HYBRID"), TypeError, "fp8_format"),
    (dict(amax_history_len=0), ValueError, "amax_history_len"),
    (dict(amax_history_len=2.0), TypeError, "amax_history_len"),
    (dict(amax_compute_algo="mean"), ValueError, "amax_compute_algo"),
    (dict(reduce_amax=1), TypeError, "reduce_amax"),
])
def test_delayed_scaling_rejects_bad_fields(kwargs, error, match):
    with pytest.raises(error, match=match):
        recipe.DelayedScaling(**kwargs)


def test_current_scaling_rejects_a_bad_format():
    with pytest.raises(TypeError, match="fp8_format"):
        recipe.Float8CurrentScaling(fp8_format=torch.float8_e4m3fn)
