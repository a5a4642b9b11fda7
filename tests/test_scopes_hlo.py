"""Scope rules on hand-written HLO text: the patterns of a user's dump cut down to the instructions that decide
the labels (no jax needed)."""

from __future__ import annotations

from parsers.hlo_text import parse_hlo_text
from traceroof.scopes import assign_scopes

_FWD = 'metadata={op_name="jit(train_step)/jvp(layer0)/moe/shard_map/'
_BWD = 'metadata={op_name="jit(train_step)/transpose(jvp(layer0))/moe/shard_map/'

# An MoE block as jax 0.10 XLA CPU compiles it (/work/trial_s27 moe.py): dispatch's all-to-all, then in
# expert_ffn ``h = gelu(x @ w1); y = h @ w2``, then combine's all-to-all, which XLA CPU runs on per-peer slices of
# ``y`` and concatenates after, all three named combine/all_to_all. The matmuls are ``ynn_fusion``s that lost
# their metadata, the fused dot too. Backward: combine's all-to-all again, then y's two gradients (w.r.t. h
# and w2), also unnamed, and the gelu's gradient.
_MOE = f"""HloModule jit_train_step

%ynn_w1 (p0: f32[32,64], p1: f32[64,128]) -> f32[32,128] {{
  %p0 = f32[32,64]{{1,0}} parameter(0)
  %p1 = f32[64,128]{{1,0}} parameter(1)
  ROOT %dot.1 = f32[32,128]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%ynn_w2 (q0: f32[32,128], q1: f32[128,64]) -> f32[32,64] {{
  %q0 = f32[32,128]{{1,0}} parameter(0)
  %q1 = f32[128,64]{{1,0}} parameter(1)
  ROOT %dot.2 = f32[32,64]{{1,0}} dot(%q0, %q1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%ynn_dh (r0: f32[32,64], r1: f32[128,64]) -> f32[32,128] {{
  %r0 = f32[32,64]{{1,0}} parameter(0)
  %r1 = f32[128,64]{{1,0}} parameter(1)
  ROOT %dot.3 = f32[32,128]{{1,0}} dot(%r0, %r1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}
}}

ENTRY %main (x: f32[32,64], w1: f32[64,128], w2: f32[128,64]) -> (f32[32,64], f32[32,128], f32[128,64]) {{
  %x = f32[32,64]{{1,0}} parameter(0), metadata={{op_name="x"}}
  %w1 = f32[64,128]{{1,0}} parameter(1), metadata={{op_name="state['w1']"}}
  %w2 = f32[128,64]{{1,0}} parameter(2), metadata={{op_name="state['w2']"}}
  %dispatch = f32[32,64]{{1,0}} all-to-all(%x), channel_id=1, replica_groups={{{{0,1}}}}, dimensions={{0}}, \
{_FWD}dispatch/all_to_all"}}
  %ynn_fusion.46 = f32[32,128]{{1,0}} fusion(%dispatch, %w1), kind=kCustom, calls=%ynn_w1
  %gelu = f32[32,128]{{1,0}} tanh(%ynn_fusion.46), {_FWD}expert_ffn/tanh"}}
  %ynn_fusion.45 = f32[32,64]{{1,0}} fusion(%gelu, %w2), kind=kCustom, calls=%ynn_w2
  %slice.0 = f32[16,64]{{1,0}} slice(%ynn_fusion.45), slice={{[0:16], [0:64]}}, {_FWD}combine/all_to_all"}}
  %slice.1 = f32[16,64]{{1,0}} slice(%ynn_fusion.45), slice={{[16:32], [0:64]}}, {_FWD}combine/all_to_all"}}
  %combine = (f32[16,64]{{1,0}}, f32[16,64]{{1,0}}) all-to-all(%slice.0, %slice.1), channel_id=2, \
replica_groups={{{{0,1}}}}, {_FWD}combine/all_to_all"}}
  %c0 = f32[16,64]{{1,0}} get-tuple-element(%combine), index=0, {_FWD}combine/all_to_all"}}
  %c1 = f32[16,64]{{1,0}} get-tuple-element(%combine), index=1, {_FWD}combine/all_to_all"}}
  %y = f32[32,64]{{1,0}} concatenate(%c0, %c1), dimensions={{0}}, {_FWD}combine/all_to_all"}}
  %one = f32[] constant(1)
  %dy = f32[32,64]{{1,0}} broadcast(%one), dimensions={{}}, {_BWD}mul"}}
  %dslice.0 = f32[16,64]{{1,0}} slice(%dy), slice={{[0:16], [0:64]}}, {_BWD}combine/all_to_all"}}
  %dslice.1 = f32[16,64]{{1,0}} slice(%dy), slice={{[16:32], [0:64]}}, {_BWD}combine/all_to_all"}}
  %dcombine = (f32[16,64]{{1,0}}, f32[16,64]{{1,0}}) all-to-all(%dslice.0, %dslice.1), channel_id=3, \
replica_groups={{{{0,1}}}}, {_BWD}combine/all_to_all"}}
  %d0 = f32[16,64]{{1,0}} get-tuple-element(%dcombine), index=0, {_BWD}combine/all_to_all"}}
  %d1 = f32[16,64]{{1,0}} get-tuple-element(%dcombine), index=1, {_BWD}combine/all_to_all"}}
  %dcat = f32[32,64]{{1,0}} concatenate(%d0, %d1), dimensions={{0}}, {_BWD}combine/all_to_all"}}
  %ynn_fusion.17 = f32[32,128]{{1,0}} fusion(%dcat, %w2), kind=kCustom, calls=%ynn_dh
  %dgelu = f32[32,128]{{1,0}} multiply(%ynn_fusion.17, %ynn_fusion.46), {_BWD}expert_ffn/mul"}}
  %dot.87 = f32[128,64]{{1,0}} dot(%gelu, %dcat), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
  %dw2 = f32[128,64]{{1,0}} copy(%dot.87), {_BWD}expert_ffn/ecf,efd->ecd/transpose"}}
  ROOT %out = (f32[32,64]{{1,0}}, f32[32,128]{{1,0}}, f32[128,64]{{1,0}}) tuple(%y, %dgelu, %dw2)
}}
"""


def test_unnamed_matmul_next_to_a_collective_takes_the_scope_on_its_other_side():
    """A user's MoE (/work/trial_s27): the expert w2 matmul (524 k FLOP forward, 1.05 M backward per layer) was
    put under combine, the all-to-all after it, from its users; its backward under combine, from the gradient
    the all-to-all delivers. A collective only moves data, so no matmul was made from one: the scope is the
    other neighbour's, the producer's or the user's, whichever is not the collective (w1's matmul, after
    dispatch's all-to-all, takes its user's)."""
    (m,) = parse_hlo_text(_MOE)
    ms = assign_scopes(m)
    ffn = "layer0/moe/expert_ffn"
    got = {n: (ms.get(n).scope, ms.get(n).phase) for n in ("ynn_fusion.46", "ynn_fusion.45", "ynn_fusion.17",
                                                            "dot.87", "slice.0", "dcat")}
    assert got == {"ynn_fusion.46": (ffn, "forward"), "ynn_fusion.45": (ffn, "forward"),
                   "ynn_fusion.17": (ffn, "backward"), "dot.87": (ffn, "backward"),
                   "slice.0": ("layer0/moe/combine", "forward"),
                   "dcat": ("layer0/moe/combine", "backward")}, got
    # the fused dots follow their fusions
    assert ms.get("dot.2").scope == ms.get("dot.3").scope == ffn


def test_unnamed_matmul_between_collectives_only_takes_theirs():
    """With no other labelled neighbour, the collective's label is still the witness: never no scope."""
    (m,) = parse_hlo_text(f"""HloModule jit_train_step

ENTRY %main (x: f32[8,8], w: f32[8,8]) -> f32[8,8] {{
  %x = f32[8,8]{{1,0}} parameter(0), metadata={{op_name="x"}}
  %w = f32[8,8]{{1,0}} parameter(1), metadata={{op_name="w"}}
  %a = f32[8,8]{{1,0}} all-to-all(%x), channel_id=1, replica_groups={{{{0,1}}}}, dimensions={{0}}, \
{_FWD}dispatch/all_to_all"}}
  %d = f32[8,8]{{1,0}} dot(%a, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %b = f32[8,8]{{1,0}} all-to-all(%d), channel_id=2, replica_groups={{{{0,1}}}}, dimensions={{0}}, \
{_FWD}combine/all_to_all"}}
}}
""")
    d = assign_scopes(m).get("d")
    assert (d.scope, d.phase) == ("layer0/moe/combine", "forward")


# A data-parallel conv net's weight gradient as jax 0.10 XLA CPU compiles it (/work/trial_s27b unet.py over 8
# devices): the kernel-gradient convolution is a ynn_fusion without metadata; its operands are the layer's input
# and the gradient of its output, which comes from the next layer's backward (a GroupNorm's, here); its only user is
# XLA's layout transpose of the result, which keeps the convolution's own op_name; then one all-reduce of every
# gradient (XLA's combiner), a bf16 cast and the optimizer, too far for the weight-gradient rule to reach the
# parameter.
_DP_CONV = """HloModule jit_train_step

%ynn_wgrad (p0: f32[8,16,16,4], p1: f32[8,16,16,32]) -> f32[4,3,3,32] {
  %p0 = f32[8,16,16,4]{3,2,1,0} parameter(0)
  %p1 = f32[8,16,16,32]{3,2,1,0} parameter(1)
  ROOT %conv.1 = f32[4,3,3,32]{3,2,1,0} convolution(%p0, %p1), window={size=16x16 pad=1_1x1_1}, dim_labels=f01b_i01o->01bf
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8,16,16,4], dy: f32[8,16,16,32], g: f32[32]) -> (f32[3,3,4,32], f32[32]) {
  %x = f32[8,16,16,4]{3,2,1,0} parameter(0), metadata={op_name="x"}
  %dy = f32[8,16,16,32]{3,2,1,0} parameter(1), metadata={op_name="dy"}
  %g = f32[32]{0} parameter(2), metadata={op_name="g"}
  %norm_bwd = f32[8,16,16,32]{3,2,1,0} multiply(%dy, %dy), metadata={op_name="jit(train_step)/transpose(jvp(UNet))/down1/norm1/mul"}
  %wgrad = f32[4,3,3,32]{3,2,1,0} fusion(%x, %norm_bwd), kind=kCustom, calls=%ynn_wgrad
  %wgrad_t = f32[3,3,4,32]{3,2,1,0} transpose(%wgrad), dimensions={1,2,0,3}, metadata={op_name="jit(train_step)/transpose(jvp(UNet))/conv_in/conv_general_dilated"}
  %ar = (f32[3,3,4,32]{3,2,1,0}, f32[32]{0}) all-reduce(%wgrad_t, %g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, metadata={op_name="jit(train_step)/transpose(jvp(UNet))/conv_in/conv_general_dilated"}
  %k = f32[3,3,4,32]{3,2,1,0} get-tuple-element(%ar), index=0
  %gn = f32[32]{0} get-tuple-element(%ar), index=1
  ROOT %out = (f32[3,3,4,32]{3,2,1,0}, f32[32]{0}) tuple(%k, %gn)
}
"""


def test_a_weight_gradient_takes_the_layer_its_own_transpose_names():
    """The user's 18 kernel gradients read as their next layers' GroupNorm backward rows (conv_in's under
    down1/norm1, 26 MFLOP of convolution in a norm's backward), from the gradient operand: the transpose XLA made of
    the result carries the convolution's own name and layer."""
    (m,) = parse_hlo_text(_DP_CONV)
    s = assign_scopes(m)
    assert (s.get("wgrad").scope, s.get("wgrad").phase) == ("UNet/conv_in", "backward")
    assert s.get("norm_bwd").scope == "UNet/down1/norm1"


def test_a_fused_matmul_names_a_fusion_named_after_its_epilogue():
    """XLA CPU fuses the head's dot with the loss's log-softmax max and names the fusion after the max: a user's
    MoE showed the head forward at 33 kFLOP and the loss at 33 MFLOP (s35 trial). The dot inside names it."""
    import jax
    import jax.numpy as jnp

    def loss(p, x, y):
        with jax.named_scope("body"):
            h = jnp.tanh(x @ p["w"])
        with jax.named_scope("head"):
            logits = h @ p["head"]
        with jax.named_scope("loss"):
            return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), y[:, None], -1).mean()

    p = {"w": jnp.ones((128, 128)), "head": jnp.ones((128, 512))}
    (m,) = parse_hlo_text(jax.jit(jax.grad(loss)).lower(p, jnp.ones((252, 128)), jnp.zeros(252, jnp.int32))
                          .compile().as_text())
    scopes = assign_scopes(m)
    fused = {}
    for comp in m.computations.values():
        for inst in comp.instructions:
            dots = [i for c in inst.called for i in m.computations[c].instructions if i.opcode == "dot"] \
                if inst.opcode == "fusion" else []
            if dots and "jvp(head)/dot_general" in dots[0].metadata.op_name:
                fused[inst.name] = inst.metadata.op_name
    # the case: a fusion whose own name is the loss's, holding the head's forward dot
    (name,) = [n for n, op_name in fused.items() if "jvp(loss)" in op_name]
    assert (scopes.get(name).scope, scopes.get(name).phase) == ("head", "forward")


_WHOLE_FORWARD = """HloModule jit_test_step, entry_computation_layout={(f32[3,3,8,16]{3,2,1,0}, f32[256,10]{1,0}, f32[4,4,4,8]{3,2,1,0})->f32[4,10]{1,0}}

%fused_computation (param_0: f32[4,4,4,8], param_1: f32[3,3,8,16], param_2: f32[256,10]) -> f32[4,10] {
  %param_0 = f32[4,4,4,8]{3,2,1,0} parameter(0)
  %param_1 = f32[3,3,8,16]{3,2,1,0} parameter(1)
  %conv = f32[4,4,4,16]{3,2,1,0} convolution(%param_0, %param_1), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, metadata={op_name="jit(test_step)/block1_conv/convolution"}
  %relu = f32[4,4,4,16]{3,2,1,0} maximum(%conv, %conv), metadata={op_name="jit(test_step)/block1_relu/jit(relu)/max"}
  %flat = f32[4,256]{1,0} bitcast(%relu)
  %param_2 = f32[256,10]{1,0} parameter(2)
  ROOT %dot = f32[4,10]{1,0} dot(%flat, %param_2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(test_step)/logits/dot_general"}
}

ENTRY %main (w: f32[3,3,8,16], wd: f32[256,10], x: f32[4,4,4,8]) -> f32[4,10] {
  %x = f32[4,4,4,8]{3,2,1,0} parameter(2)
  %w = f32[3,3,8,16]{3,2,1,0} parameter(0)
  %wd = f32[256,10]{1,0} parameter(1)
  ROOT %ynn_fusion = f32[4,10]{1,0} fusion(%x, %w, %wd), kind=kCustom, calls=%fused_computation
}
"""


def test_a_fusion_of_several_layers_matmuls_is_theirs_together():
    """s42 trial (Keras CNN, XLA:CPU): the evaluation step's forward, convolutions and dense layers of 13 scopes,
    came as one XNNPACK fusion without metadata of its own, and all of it (1.2 GFLOP) was charged to the first
    layer's row, block1_conv. Modelled on it: a fusion holding block1_conv's convolution and logits' dot is
    neither layer's alone."""
    (m,) = parse_hlo_text(_WHOLE_FORWARD)
    info = assign_scopes(m).get("ynn_fusion")
    assert info.scope == "(combined)" and info.phase == "forward"
    one = _WHOLE_FORWARD.replace('"jit(test_step)/logits/dot_general"', '"jit(test_step)/block1_conv/dot"')
    (m,) = parse_hlo_text(one)
    assert assign_scopes(m).get("ynn_fusion").scope == "block1_conv"  # one layer's matmuls: that layer's
