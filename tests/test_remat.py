"""The remat setting as one type: parsed once where a string enters, asked everywhere below."""

import dataclasses
import json
import pickle

import pytest
import torch

from fused_remat import LanguageModel, ModelConfig, TransformerBlock, reference
from fused_remat.block import _BlockCall
from fused_remat.remat import KEPT_FOR_BACKWARD, Remat, parse_per_layer


def test_each_policy_says_what_it_keeps_replays_and_where():
    every = {k.name for k in KEPT_FOR_BACKWARD}
    outputs = {"y1", "y2", "a"}
    assert Remat.NONE.keeps == every
    assert Remat.CHEAP.keeps == every - outputs
    assert Remat.SELECTIVE.keeps == {"x", "o", "lse"}
    assert Remat.FULL.keeps == Remat.OFFLOAD.keeps == {"x"}
    assert [p for p in Remat if p.replays] == [Remat.SELECTIVE, Remat.FULL, Remat.OFFLOAD]
    assert [p for p in Remat if p.replays_attention] == [Remat.FULL, Remat.OFFLOAD]
    assert [p for p in Remat if p.host_resident] == [Remat.OFFLOAD]
    assert [p for p in Remat if not p.rebuilds_outputs] == [Remat.NONE]
    assert [k.name for k in Remat.CHEAP.kept()] == [k.name for k in KEPT_FOR_BACKWARD if k.name not in outputs]


def test_a_policy_is_its_name_for_printing_comparing_and_serializing():
    assert Remat.CHEAP == "cheap" and f"{Remat.FULL:<6}|" == "full  |" and str(Remat.OFFLOAD) == "offload"
    assert json.loads(json.dumps({"remat": Remat.NONE})) == {"remat": "none"}
    assert pickle.loads(pickle.dumps(Remat.FULL)) is Remat.FULL
    assert {Remat.CHEAP: 1}["cheap"] == 1


def test_parse_takes_names_and_members_and_refuses_the_rest_naming_the_owner():
    assert Remat.parse("full") is Remat.FULL and Remat.parse(Remat.CHEAP) is Remat.CHEAP
    supported = (Remat.NONE, Remat.FULL)
    with pytest.raises(ValueError, match=r"^--remat must be one of none, full, got 'cheap'$"):
        Remat.parse("cheap", supported, owner="--remat")
    for wrong in ("Full", "", None, 1, ["full"]):
        with pytest.raises(ValueError, match="remat must be one of none, cheap, selective, full, offload"):
            Remat.parse(wrong)


def test_per_layer_lists_come_as_one_name_a_sequence_or_a_comma_list():
    assert parse_per_layer("cheap", 3) == [Remat.CHEAP] * 3
    assert parse_per_layer(["full", Remat.CHEAP], 2) == [Remat.FULL, Remat.CHEAP]
    assert parse_per_layer("offload,full,cheap", 3) == [Remat.OFFLOAD, Remat.FULL, Remat.CHEAP]
    with pytest.raises(ValueError, match="^layers: got 2 policies for 3 layers$"):
        parse_per_layer("full,cheap", 3, owner="layers")
    with pytest.raises(ValueError, match="got 'lazy'"):
        parse_per_layer(["full", "lazy"], 2)


def test_blocks_and_models_hold_members_whatever_they_were_given():
    block = TransformerBlock(16, 2, remat="full")
    assert block.remat is Remat.FULL
    block.remat = "offload"
    assert block.remat is Remat.OFFLOAD
    with pytest.raises(ValueError, match="^TransformerBlock: remat must be one of none, cheap, selective, full, offload, "
                       "or 'keep:' and the tensors to keep besides x, got 'x'$"):
        block.remat = "x"
    with pytest.raises(ValueError, match="^TransformerBlock: remat 'keep:o': o and lse are kept or rebuilt together"):
        block.remat = "keep:o"
    with pytest.raises(ValueError, match="^TransformerBlock: remat 'keep:q,v': unknown kept tensor.s. q, v; choose among"):
        block.remat = "keep:q,v"
    with pytest.raises(ValueError, match="^TransformerBlock: remat must be one of none, full, got 'keep:h'$"):
        reference.TransformerBlock(16, 2).remat = "keep:h"
    assert block.remat is Remat.OFFLOAD, "a refused setting leaves the block as it was"
    assert reference.TransformerBlock(16, 2).remat is Remat.NONE
    model = LanguageModel(ModelConfig(dim=16, n_layers=3, n_heads=2), "full,cheap,none")
    assert model.remat == [Remat.FULL, Remat.CHEAP, Remat.NONE]
    assert all(type(policy) is Remat for policy in model.remat)


def test_the_custom_ops_take_the_call_by_its_fields_and_get_it_back():
    """The block operators' schema holds integers, floats and strings: each _BlockCall field, by its
    annotation, becomes those and comes back equal, the point as the member itself."""
    plain = _BlockCall(batch=1, seq=2, dim=8, n_heads=2, n_kv_heads=2, head_dim=4, ffn_dim=32, rms=True,
                       activation="gelu", causal=True, eps=1e-5, rope_theta=None, remat=Remat.OFFLOAD,
                       compute_dtype=torch.float32)
    every_field = dataclasses.replace(
        plain, rope_theta=5e5, remat=Remat.keeping(["o", "lse", "h"]), compute_dtype=torch.bfloat16,
        context_parallel="cp-group", window=(127, 0), softcap=30.0, max_seqlen=9, scale=0.1, qk_norm=True,
        max_seqlen_k=7, first_keys=3, adapters=((0, 0, 8, 11, 2.0, 0.0), (3, 4, 4, 12, 0.5, 0.1)))
    for call in (plain, every_field):
        ints, floats, names = call.op_args()
        assert all(type(n) is int for n in ints) and all(type(f) is float for f in floats) and type(names) is str
        back = _BlockCall.from_op_args(ints, floats, names)
        assert back == call and back.remat is call.remat
    assert every_field.op_args()[2].split("\x1f") == ["gelu", "keep:o,lse,h", "bfloat16", "cp-group"]
