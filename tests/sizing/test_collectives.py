"""The collectives read from HLO text (`jopd.sizing.collectives`) and their time in the roofline: hand-written
instructions of each kind against bytes counted by hand, and a compiled program on the 8 host CPU devices
whose all-gather and all-reduce are known from its shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jopd.sizing.collectives import Collective, collectives, shape_bytes
from jopd.sizing.roofline import CHIP_PEAKS, Cost, Part, StageCost

# One instruction of each kind and form, as XLA prints them (layouts, tuple results, the async start/done pairs,
# the three spellings of replica groups), with what a hand count gives: (kind, result bytes, group size).
HLO = """
%ag = f32[8,128]{1,0} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
%ags = (bf16[2,64]{1,0:T(8,128)(2,1)}, bf16[8,64]{1,0:T(8,128)(2,1)}) all-gather-start(%p1), replica_groups=[2,4]<=[8], dimensions={0}
%agd = bf16[8,64]{1,0:T(8,128)(2,1)} all-gather-done(%ags)
%rs = f32[16]{0} reduce-scatter(%p2), replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}, to_apply=%add
%ar = (f32[10]{0}, bf16[6]{0}) all-reduce(%p3, %p4), replica_groups={}, to_apply=%add
%ars = f32[100]{0} all-reduce-start(%p5), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
%ard = f32[100]{0} all-reduce-done(%ars)
%a2a = s32[4,32]{1,0} all-to-all(%p6), replica_groups=mesh['x'=8] {'x'}, dimensions={0}
%a2t = (f32[2,4]{1,0}, f32[2,4]{1,0}, f32[2,4]{1,0}, f32[2,4]{1,0}, /*index=4*/f32[2,4]{1,0}) all-to-all(%p7, %p8, %p9, %p10, %p11), replica_groups=mesh['a'=4,'b'=2] {'a':(2)2}
%cps = (bf16[512,1,256]{2,0,1:T(8,128)(2,1)S(1)}, bf16[512,1,256]{2,0,1:T(8,128)(2,1)S(1)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%p12), channel_id=3, source_target_pairs={{0,1},{1,0}}
%cpd = bf16[512,1,256]{2,0,1} collective-permute-done(%cps)
%self = f32[64]{0} collective-permute(%p13), source_target_pairs={{0,0},{1,1}}
%fusion = f32[8,128]{1,0} fusion(%ag, %all-gather.3), kind=kLoop, calls=%fused, metadata={op_name="all-gather(x)"}
%all-reduce.9 = f32[4]{0} add(%p14, %p15)
"""
EXPECTED = [
    ("all-gather", 8 * 128 * 4, 4),
    ("all-gather", 8 * 64 * 2, 4),  # the start's result is the tuple's second element; the done is not counted
    ("reduce-scatter", 16 * 4, 4),
    ("all-reduce", 10 * 4 + 6 * 2, 8),  # no groups: every device
    ("all-reduce", 100 * 4, 2),
    ("all-to-all", 4 * 32 * 4, 8),
    ("all-to-all", 5 * 2 * 4 * 4, 2),  # a sub-axis of size 2; the printer's /*index=4*/ comment
    ("collective-permute", 512 * 256 * 2, 2),  # a permute only to itself sends nothing: not listed
]


def test_each_kind_by_hand():
    ops = collectives(HLO, num_devices=8)
    assert [(c.kind, c.result_bytes, c.group) for c in ops] == EXPECTED
    # bytes each device sends and ring steps: (n-1)/n of the gathered result, (n-1) shards, 2(n-1)/n for all-reduce
    assert [c.sent_bytes for c in ops] == [3 / 4 * 4096, 3 / 4 * 1024, 3 * 64, 2 * 7 / 8 * 52, 400, 7 / 8 * 512,
                                           1 / 2 * 160, 262144]
    assert [c.steps for c in ops] == [3, 3, 3, 14, 2, 7, 1, 1]
    assert Collective("all-reduce", 100.0, 1).sent_bytes == 0 and Collective("all-gather", 8.0, 1).steps == 0
    assert shape_bytes("(pred[3], (s4[4], f8e4m3fn[2]{0}))") == (3.0, (2.0, 2.0))


def test_a_compiled_programs_collectives_on_8_cpu_devices():
    """A matmul with its weight's rows gathered over the 4 devices of axis b and the product summed over the 2 of
    axis a: one all-gather of the [64, 256] f32 block and one all-reduce of the [16, 256] product."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))

    def f(x_blk, w_blk):  # x [16, 64] per device (columns over a); w [16, 256] per device (rows over a, b)
        w_b = jax.lax.all_gather(w_blk, "b", tiled=True)  # [64, 256]: the rows of this device's a-shard
        return jax.lax.psum(x_blk @ w_b, "a")

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "a"), P(("a", "b"))), out_specs=P(), check_vma=False))
    x, w = jax.ShapeDtypeStruct((16, 128), jnp.float32), jax.ShapeDtypeStruct((128, 256), jnp.float32)
    compiled = g.lower(x, w).compile()
    ops = collectives(compiled.as_text(), 8)
    assert sorted((c.kind, c.result_bytes, c.group) for c in ops) == [("all-gather", 64 * 256 * 4, 4),
                                                                       ("all-reduce", 16 * 256 * 4, 2)]
    cost = Cost.of(compiled, num_devices=8)
    assert cost.ici_bytes == 3 / 4 * 65536 + 2 * 1 / 2 * 16384 and cost.ici_steps == 3 + 2


def test_collective_time_in_the_stage():
    """A part's time is max(compute, HBM) + ICI (bytes / (chip bandwidth / ports) + steps x hop latency), and with
    overlap max of the three."""
    peak = CHIP_PEAKS["v5e"]
    ring = peak.ici.bytes_per_s / peak.ici.ports  # 100 GB/s: 400 GB/s over 4 ports
    cost = Cost(0.2 * peak.flops, 0.1 * peak.hbm_bytes_per_s, ici_bytes=0.3 * ring, ici_steps=1000)
    ici = 0.3 + 1000 * peak.ici.hop_s
    stage = StageCost("train_step", (Part("update", 2, cost),))
    assert stage.ici_seconds(peak) == pytest.approx(2 * ici)
    assert stage.seconds(peak) == pytest.approx((0.4, 0.2, 2 * (0.2 + ici)))
    assert stage.overlapped_seconds(peak) == pytest.approx(2 * ici) and stage.bound(peak) == "ICI"
    assert ring == 100e9 and CHIP_PEAKS["v5p"].ici.bytes_per_s / CHIP_PEAKS["v5p"].ici.ports == 200e9
