"""ternop.selection.fused_groups: the layers a serving engine fuses, kept together."""

from __future__ import annotations

from ternop.selection import fused_groups


def test_fused_groups_join_the_parts_vllm_fuses_and_leave_the_rest_alone():
    names = ["m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.v_proj",
             "m.layers.0.self_attn.o_proj", "m.layers.0.mlp.up_proj", "m.layers.0.mlp.gate_proj",
             "m.layers.0.mlp.down_proj", "encoder.layer.1.attention.self.query", "encoder.layer.1.attention.self.key",
             "encoder.layer.1.attention.self.value", "encoder.layer.1.attention.output.dense"]  # fmt: skip
    assert fused_groups(names) == [
        ("m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj"),
        ("m.layers.0.self_attn.o_proj",),
        ("m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj"),
        ("m.layers.0.mlp.down_proj",),
        ("encoder.layer.1.attention.self.query", "encoder.layer.1.attention.self.key",
         "encoder.layer.1.attention.self.value"),
        ("encoder.layer.1.attention.output.dense",),
    ]  # fmt: skip


def test_fused_groups_need_every_part_and_one_parent():
    # A part whose siblings are missing (left dense by --skip, or another parent's) stays alone.
    names = ["a.q_proj", "a.k_proj", "b.v_proj", "gate_proj", "up_proj", "c.gate_proj"]
    assert fused_groups(names) == [("a.q_proj",), ("a.k_proj",), ("b.v_proj",), ("gate_proj", "up_proj"),
                                   ("c.gate_proj",)]  # fmt: skip
    assert fused_groups([]) == []
