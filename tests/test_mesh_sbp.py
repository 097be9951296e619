"""Mesh construction and SBP arithmetic, including property-based checks."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from ddlc.errors import MeshError, SBPError
from ddlc.mesh import LinkModel, Mesh, available_profiles, load_profile
from ddlc.sbp import B, NdSBP, P, S, divides, local_shape, local_slices, parse_sbp


def test_mesh_from_tuple_string_and_names():
    assert Mesh("2x4").shape == (2, 4)
    assert Mesh("(2, 2, 2)").shape == (2, 2, 2)
    assert Mesh("(4,)").shape == (4,) and Mesh("(2, 4,)").shape == (2, 4)  # as Python writes tuples
    assert Mesh(8).shape == (8,)
    m = Mesh((2, 4), ("data", "model"))
    assert m.axis_names == ("data", "model") and m.size == 8 and m.ndim == 2
    assert m.axis("model") == 1 and str(m) == "2x4(data,model)"


@pytest.mark.parametrize("bad", ["2x", "axb", (), (0, 2), (2, -1), (2.0,), "", (True, 2)])
def test_bad_mesh_shapes_fail_clearly(bad):
    with pytest.raises(MeshError, match="mesh shape"):
        Mesh(bad)


def test_bad_axis_names_and_profile():
    with pytest.raises(MeshError, match="names"):
        Mesh((2, 2), ("dp",))
    with pytest.raises(MeshError, match="distinct"):
        Mesh((2, 2), ("dp", "dp"))
    with pytest.raises(MeshError, match="unknown hardware profile"):
        Mesh((2,), profile="no-such-machine")
    with pytest.raises(MeshError, match="no axis named"):
        Mesh((2, 2)).axis("pp")


def test_world_size_check_names_both_numbers():
    with pytest.raises(MeshError, match="needs 4 processes but the world size is 2"):
        Mesh((2, 2)).check_world_size(2)


def test_profiles_assign_intra_and_inter_node_links():
    assert {"cpu-gloo", "dgx-h100-ib"} <= set(available_profiles())
    prof = load_profile("dgx-h100-ib")
    m = Mesh((4, 8), profile=prof)
    assert m.links == (prof.inter_node, prof.intra_node)
    assert Mesh((2, 4), profile=prof).links == (prof.intra_node, prof.intra_node)
    custom = Mesh((2,), links=[LinkModel(1e-6, 1e9)])
    assert custom.links[0].beta == pytest.approx(1e-9)


def test_mesh_from_device_mesh_on_fake_process_group():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        dm = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        m = Mesh.of(dm)
        assert m.shape == (2, 4) and m.axis_names == ("dp", "tp") and m.profile.name == "cpu-gloo"
    finally:
        dist.destroy_process_group()


def test_coordinates_and_axis_groups():
    m = Mesh((2, 3))
    assert [m.coordinate(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(m.rank_of(m.coordinate(r)) == r for r in range(6))
    assert m.axis_groups(0) == [[0, 3], [1, 4], [2, 5]]
    assert m.axis_groups(1) == [[0, 1, 2], [3, 4, 5]]


def test_sbp_printing_parsing_and_order():
    x = NdSBP((S(0), B))
    assert str(x) == "(S0, B)" and parse_sbp("(S0, B)") == x and parse_sbp("S1,P") == NdSBP((S(1), P))
    assert sorted([S(1), P, S(0), B]) == [B, P, S(0), S(1)]
    assert len({NdSBP((S(0), B)), NdSBP((S(0), B))}) == 1
    with pytest.raises(SBPError):
        S(-1)
    with pytest.raises(SBPError):
        parse_sbp("(Q, B)")


def test_local_shapes_even_and_uneven():
    assert local_shape((8, 6), NdSBP((S(0), S(1))), (2, 3)) == (4, 2)
    assert local_shape((8, 6), NdSBP((S(0), S(0))), (2, 2)) == (2, 6)
    # torch.chunk semantics: 10 rows on 4 ranks -> 3, 3, 3, 1
    sizes = [local_shape((10,), NdSBP((S(0),)), (4,), (c,))[0] for c in range(4)]
    assert sizes == [3, 3, 3, 1]
    assert not divides((10,), NdSBP((S(0),)), (4,)) and divides((12,), NdSBP((S(0),)), (4,))
    assert local_shape((8, 6), NdSBP((P, B)), (2, 2)) == (8, 6)
    with pytest.raises(SBPError, match="splits dim 2"):
        local_shape((8, 6), NdSBP((S(2), B)), (2, 2))


def test_nested_split_puts_axis_zero_outermost():
    # dim 0 split on both axes of a 2x2 mesh: device (i, j) holds piece 2*i + j
    x = torch.arange(8)
    sbp = NdSBP((S(0), S(0)))
    pieces = {(i, j): x[local_slices((8,), sbp, (2, 2), (i, j))].tolist()
              for i in range(2) for j in range(2)}
    assert pieces == {(0, 0): [0, 1], (0, 1): [2, 3], (1, 0): [4, 5], (1, 1): [6, 7]}


sbps = st.one_of(st.just(B), st.just(P), st.integers(0, 2).map(S))


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=3, max_size=3),
       mesh=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data())
def test_local_pieces_tile_the_tensor(shape, mesh, data):
    sbp = NdSBP(tuple(data.draw(sbps) for _ in mesh))
    coords = [tuple(c) for c in __import__("itertools").product(*(range(p) for p in mesh))]
    covered = torch.zeros(shape, dtype=torch.int64)
    for c in coords:
        covered[local_slices(shape, sbp, mesh, c)] += 1
    # each element is held once per replica: product of the non-split axes
    replicas = math.prod(p for x, p in zip(sbp, mesh) if not x.is_split)
    assert bool((covered == replicas).all())
    if divides(shape, sbp, mesh):
        assert len({local_shape(shape, sbp, mesh, c) for c in coords}) == 1


@settings(max_examples=100, deadline=None)
@given(data=st.data(), ndim=st.integers(1, 3))
def test_dtensor_placement_round_trip(data, ndim):
    sbp = NdSBP(tuple(data.draw(sbps) for _ in range(ndim)))
    placements = sbp.to_placements()
    assert all(isinstance(p, (Shard, Replicate, Partial)) for p in placements)
    assert NdSBP.from_placements(placements) == sbp


def test_unsupported_placement_is_rejected():
    with pytest.raises(SBPError, match="no SBP equivalent"):
        NdSBP.from_placements([Partial("max")])


@pytest.mark.parametrize("edit, cause", [
    (lambda d: d.update(flops="fast"), "field 'flops' is mistyped or out of range: 'fast'"),
    (lambda d: d["flops"].update(float32="abc"), "field 'flops' is mistyped or out of range"),
    (lambda d: d.update(links="fast"), "has no field 'links.intra_node'"),
    (lambda d: d["links"].update(intra_node={"latency": 1e-6, "bandwidth": -1}), "'links.intra_node' is mistyped"),
    (lambda d: d.update(contention=5), "field 'contention' is mistyped"),
    (lambda d: d.update(memory_capacity=-1), "field 'memory_capacity' is mistyped or out of range: -1 (must be a "
                                             "positive number)"),
    (lambda d: d.pop("memory_bandwidth"), "has no field 'memory_bandwidth'"),
    # found by a second look: tracebacks, or taken as something else
    (lambda d: d.update(devices_per_node=float("inf")), "'devices_per_node' is mistyped or out of range: inf"),
    (lambda d: d["flops"].update(float32=True), "field 'flops' is mistyped"),
    (lambda d: d["flops"].update(float32="1e11"), "field 'flops' is mistyped"),
    (lambda d: d.update(flops={"bfloat16": 1e11}), "float32 among them"),
    (lambda d: d.update(emulated_collectives={"reduce_scatter": "teleport"}), "'emulated_collectives' is mistyped"),
    (lambda d: d.update(collective_factors={"all_gather": {"latency": 1.0}}), "(missing bandwidth)"),
    (lambda d: d["contention"].update(startup=float("nan")), "field 'contention' is mistyped"),
    (lambda d: d.update(name=None), "field 'name' is mistyped or out of range: None (must be a string)"),
    (lambda d: d.update(devices_per_node=10 ** 400), "'devices_per_node' is mistyped"),
    (lambda d: d.update(compute="bogus"), "must be roofline or measured"),
])
def test_a_profile_file_with_a_bad_field_is_refused_naming_the_field(tmp_path, edit, cause):
    """A mistyped field of a profile file gave a Python traceback (AttributeError,
    ValueError) or a message naming no field; a negative memory capacity was taken."""
    import json
    from importlib import resources
    d = json.loads(resources.files("ddlc").joinpath("profiles/cpu-gloo.json").read_text())
    edit(d)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(d))
    with pytest.raises(MeshError) as info:
        load_profile(str(path))
    assert cause in str(info.value)
