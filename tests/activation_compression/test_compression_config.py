"""ActivationCompressionConfig: validation with errors naming the field, JSON round trip, kinds."""

from __future__ import annotations

import json

import pytest

import peft_slim
from peft_slim import ActivationCompressionConfig, compress_activations


def test_defaults_and_json_round_trip():
    config = ActivationCompressionConfig(bits=4, kinds="attention", prune_ratio=0.1, prune_kinds=["norm", "other"])
    assert config.kinds == ["attention"]
    assert config.compressed_kinds == {"attention"}
    assert config.pruned_kinds == {"norm", "other"}
    again = ActivationCompressionConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert ActivationCompressionConfig().compressed_kinds == {"attention", "norm", "activation", "linear", "other"}
    assert ActivationCompressionConfig().pruned_kinds == set()  # no prune_ratio: nothing pruned


@pytest.mark.parametrize(
    "fields, field_name",
    [
        ({"bits": 3}, "bits"),
        ({"bits": True}, "bits"),
        ({"group_size": 0}, "group_size"),
        ({"group_size": 100}, "group_size"),
        ({"group_size": 2**17}, "group_size"),
        ({"prune_ratio": 0.0}, "prune_ratio"),
        ({"prune_ratio": 1.5}, "prune_ratio"),
        ({"min_numel": -1}, "min_numel"),
        ({"offload": "yes"}, "offload"),
        ({"prune_frozen_only": 1}, "prune_frozen_only"),
        ({"kinds": ["softmax"]}, "kinds"),
        ({"kinds": []}, "kinds"),
        ({"prune_kinds": "everything"}, "prune_kinds"),
    ],
)
def test_invalid_fields_raise_naming_the_field(fields, field_name):
    with pytest.raises(ValueError, match=f"ActivationCompressionConfig.{field_name} must be"):
        ActivationCompressionConfig(**fields)


def test_from_dict_rejects_unknown_fields_and_the_verb_checks_its_argument():
    with pytest.raises(ValueError, match="no field"):
        ActivationCompressionConfig.from_dict({"bitz": 8})
    with pytest.raises(ValueError, match="takes an ActivationCompressionConfig"):
        compress_activations(8)
    context = compress_activations({"bits": 2}, group_size=64)
    assert (context.config.bits, context.config.group_size) == (2, 64)


def test_public_api():
    assert peft_slim.ActivationCompressionConfig is ActivationCompressionConfig
    assert peft_slim.compress_activations is compress_activations


def test_kind_bits_override_and_validation():
    config = ActivationCompressionConfig(bits=8, kinds=["attention"], kind_bits={"activation": 4, "attention": None})
    assert config.bits_for("activation") == 4
    assert config.bits_for("attention") is None
    assert config.bits_for("linear") is None
    assert config.compressed_kinds == frozenset({"activation"})
    assert ActivationCompressionConfig.from_dict(config.to_dict()) == config
    for bad in ({"mlp": 4}, {"activation": 3}, {"activation": True}, [("activation", 4)]):
        with pytest.raises(ValueError, match="kind_bits"):
            ActivationCompressionConfig(kind_bits=bad)
