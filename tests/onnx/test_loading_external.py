"""External data is read only from inside the model's folder, whatever way the model comes in.

Every way in (a path, an ``onnx.ModelProto``, an ``onnx_ir.Model``, a graphsurgeon ``Graph``) runs one
location check, on every external tensor: initializers and ``Constant`` values, in the main graph, subgraphs
and local functions. A model with no folder of its own has its external data refused unless the caller names
the folder. Constant values resolve against the model's folder, never the working folder. And no run writes
over a data file its input reads.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp4pass
import onnx_builders as B
from fp4pass.cli import main
from fp4pass.errors import ModelError, UnsafeExternalDataError, UsageError
from fp4pass.onnx import loading
from fp4pass.onnx.runtime import make_session


def _externalize(tensor: TensorProto, folder: Path, location: str, data_file: Path | None = None) -> None:
    """Move ``tensor``'s bytes to ``data_file`` (default: ``folder / location``) and point it at ``location``."""
    raw = numpy_helper.to_array(tensor).tobytes() if not tensor.HasField("raw_data") else tensor.raw_data
    target = data_file if data_file is not None else folder / location
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(raw)
    tensor.ClearField("raw_data")
    for field in ("float_data", "int32_data", "int64_data"):
        tensor.ClearField(field)
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", "0"), ("length", str(len(raw)))):
        tensor.external_data.add(key=key, value=value)


def _fp4_model_with_external_weight(folder: Path, location: str, data_file: Path | None = None) -> onnx.ModelProto:
    proto = B.linear_model()
    weight = next(t for t in proto.graph.initializer if t.name == "W")
    _externalize(weight, folder, location, data_file)
    return proto


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(bytes(range(256)) * 64)
    return secret


def _sha(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


# -- 1. every way in runs the same location check ----------------------------------------------------------------


@pytest.mark.parametrize("location", ["../secret.bin", "ABSOLUTE"])
def test_a_model_proto_cannot_read_outside_its_folder_through_convert(tmp_path, location):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    secret = _secret(tmp_path)
    location = str(secret) if location == "ABSOLUTE" else location
    proto = _fp4_model_with_external_weight(model_dir, location, data_file=secret)
    out = model_dir / "out.onnx"
    with pytest.raises(UnsafeExternalDataError, match="leaves the model's folder"):
        fp4pass.onnx.convert(proto, output=out, base_dir=model_dir)
    assert not out.exists()


def test_a_model_proto_with_external_data_and_no_folder_is_refused(tmp_path):
    model_dir = tmp_path / "model"
    proto = _fp4_model_with_external_weight(model_dir, "w.bin")
    with pytest.raises(UnsafeExternalDataError, match="no folder to read it from; pass base_dir="):
        fp4pass.onnx.convert(proto)
    with pytest.raises(UnsafeExternalDataError, match="base_dir="):
        fp4pass.onnx.diff(proto, proto)


def test_a_model_proto_reads_its_external_data_from_the_folder_named(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    proto = _fp4_model_with_external_weight(model_dir, "w.bin")
    monkeypatch.chdir(tmp_path)  # not the model's folder: the data must come from base_dir, not from here
    converted, report = fp4pass.onnx.convert(proto, base_dir=model_dir)
    assert report["summary"]["tensors_converted"] == 1 and report["summary"]["lossless"] == 1
    reference, _ = fp4pass.onnx.convert(B.linear_model())
    assert [numpy_helper.to_array(t).tobytes() for t in converted.graph.initializer] == \
        [numpy_helper.to_array(t).tobytes() for t in reference.graph.initializer]


def test_an_ir_model_is_checked_against_its_own_folder(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    secret = _secret(tmp_path)
    proto = _fp4_model_with_external_weight(model_dir, "../secret.bin", data_file=secret)
    onnx.save(proto, model_dir / "m.onnx")
    model = ir.load(model_dir / "m.onnx")  # onnx_ir does not refuse it: its tensors point at ../secret.bin
    with pytest.raises(UnsafeExternalDataError, match="leaves the model's folder"):
        fp4pass.onnx.convert(model)
    # an onnx_ir model whose tensors have no folder at all
    bare = ir.serde.deserialize_model(_fp4_model_with_external_weight(tmp_path / "other", "w.bin"))
    with pytest.raises(UnsafeExternalDataError, match="no folder"):
        fp4pass.onnx.convert(bare)


def test_a_graphsurgeon_graph_needs_a_folder_for_its_external_data(tmp_path):
    gs = pytest.importorskip("onnx_graphsurgeon")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    secret = _secret(tmp_path)
    proto = _fp4_model_with_external_weight(model_dir, "../secret.bin", data_file=secret)
    graph = gs.import_onnx(proto)
    with pytest.raises(UnsafeExternalDataError, match="base_dir="):
        fp4pass.onnx.convert(graph)
    with pytest.raises(UnsafeExternalDataError, match="leaves the model's folder"):
        fp4pass.onnx.convert(graph, base_dir=model_dir)


def test_a_symlink_into_a_sibling_folder_with_the_same_prefix_is_outside(tmp_path):
    """``model_evil/`` starts with the characters of ``model``: only a path comparison tells them apart."""
    model_dir, evil = tmp_path / "model", tmp_path / "model_evil"
    proto = _fp4_model_with_external_weight(evil, "w.bin")
    model_dir.mkdir()
    (model_dir / "w.bin").symlink_to(evil / "w.bin")
    onnx.save(proto, model_dir / "m.onnx")
    for call in (lambda: loading.load(model_dir / "m.onnx"), lambda: fp4pass.onnx.convert(proto, base_dir=model_dir)):
        with pytest.raises(UnsafeExternalDataError, match="outside the model's folder"):
            call()


# -- 2. Constant values stored as external data ----------------------------------------------------------------------


def _constant_model(where: str) -> onnx.ModelProto:
    """y = x + c, c a Constant [4] float32 = (1, 2, 3, 4); ``where``: the Constant sits in the main graph, an If
    branch, or a local function's body."""
    c = numpy_helper.from_array(np.arange(1, 5, dtype=np.float32), "c")
    const = helper.make_node("Constant", [], ["c"], name="c_const", value=c)
    add = helper.make_node("Add", ["x", "c"], ["y"], name="add")
    x, y = B.vi("x", [4]), B.vi("y", [4])
    if where == "graph":
        return B.make([const, add], [x], [y], [])
    if where == "subgraph":
        branch = helper.make_graph([const, add], "then", [], [B.vi("y", [4])])
        cond = numpy_helper.from_array(np.array(True), "cond")
        node = helper.make_node("If", ["cond"], ["z"], name="if", then_branch=branch, else_branch=branch)
        return B.make([node], [x], [B.vi("z", [4])], [cond])
    function = helper.make_function("local.c", "AddC", ["x"], ["y"], [const, add], B.OPSET)
    graph = helper.make_graph([helper.make_node("AddC", ["x"], ["y"], name="addc", domain="local.c")], "g", [x], [y])
    return helper.make_model(graph, functions=[function], ir_version=12,
                             opset_imports=[*B.OPSET, helper.make_opsetid("local.c", 1)])


def _constant_tensor(proto: onnx.ModelProto) -> TensorProto:
    return next(t for t in loading.proto_tensors(proto) if t.name == "c")


@pytest.mark.parametrize("where", ["graph", "subgraph", "function"])
def test_constant_external_data_resolves_against_the_models_folder(tmp_path, monkeypatch, where):
    model_dir = tmp_path / "model"
    proto = _constant_model(where)
    _externalize(_constant_tensor(proto), model_dir, "c.bin")
    onnx.save(proto, model_dir / "m.onnx")
    # a decoy in the working folder with other values: the model must not read it
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / "c.bin").write_bytes(np.full(4, 100, np.float32).tobytes())
    monkeypatch.chdir(elsewhere)
    model = loading.load(model_dir / "m.onnx").model
    assert loading.external_data_files(model) == {os.path.realpath(model_dir / "c.bin")}
    session, _, _ = make_session(model, "cpu")
    (y,) = session.run(None, {"x": np.zeros(4, np.float32)})
    np.testing.assert_array_equal(y, [1, 2, 3, 4])


@pytest.mark.parametrize("where", ["graph", "subgraph", "function"])
@pytest.mark.parametrize("location", ["../secret.bin", "ABSOLUTE"])
def test_constant_external_data_cannot_leave_the_folder_even_with_allow_invalid(tmp_path, capsys, where, location):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    secret = _secret(tmp_path)
    proto = _constant_model(where)
    _externalize(_constant_tensor(proto), model_dir, str(secret) if location == "ABSOLUTE" else location,
                 data_file=secret)
    onnx.save(proto, model_dir / "m.onnx")
    before = _sha(model_dir)
    for argv in (["convert", str(model_dir / "m.onnx"), "-o", str(model_dir / "o.onnx"), "--allow-invalid"],
                 ["diff", str(model_dir / "m.onnx"), str(model_dir / "m.onnx"), "--allow-invalid"],
                 ["inspect", str(model_dir / "m.onnx")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "leaves the model's folder" in err and "Traceback" not in err
    assert _sha(model_dir) == before


# -- 4, 5. a run never writes over the data its input reads ---------------------------------------------------------


def _external_file_model(folder: Path, name: str, data_name: str, *, all_fp4: bool) -> Path:
    """A model whose initializers live in ``data_name``; ``all_fp4``: only FP4 weights (all of them converted,
    so the rewritten model no longer reads the data file: only the record of the input protects it)."""
    proto = B.linear_model() if all_fp4 else B.linear_model(shared=True)
    if not all_fp4:
        proto.graph.initializer.append(numpy_helper.from_array(np.ones(4, np.float32), "unused_bias"))
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, folder / name, save_as_external_data=True, all_tensors_to_one_file=True, location=data_name,
              size_threshold=0)
    return folder / name


@pytest.mark.parametrize("all_fp4", [True, False])
@pytest.mark.parametrize("external_data", ["auto", "always", "never"])
def test_api_convert_refuses_an_output_whose_data_file_is_the_inputs(tmp_path, all_fp4, external_data):
    """``convert("a.onnx", output="b.onnx")`` where a.onnx keeps its weights in b.onnx.data."""
    path = _external_file_model(tmp_path, "a.onnx", "b.onnx.data", all_fp4=all_fp4)
    before = _sha(tmp_path)
    with pytest.raises(UsageError, match="b.onnx.data"):
        fp4pass.onnx.convert(path, output=tmp_path / "b.onnx", external_data=external_data)
    assert _sha(tmp_path) == before


def test_api_convert_refuses_the_data_file_of_a_proto_input(tmp_path):
    path = _external_file_model(tmp_path, "a.onnx", "b.onnx.data", all_fp4=True)
    proto = onnx.load(path, load_external_data=False)
    before = _sha(tmp_path)
    with pytest.raises(UsageError, match="b.onnx.data"):
        fp4pass.onnx.convert(proto, output=tmp_path / "b.onnx", base_dir=tmp_path)
    assert _sha(tmp_path) == before


@pytest.mark.parametrize("flag", ["--report", "--json-like-report-in-subfolder"])
def test_cli_counts_the_inputs_data_file_among_its_inputs(tmp_path, capsys, flag):
    """``convert in.onnx -o o.onnx --report in.onnx.data``, also reached through another spelling of the path."""
    path = _external_file_model(tmp_path, "in.onnx", "in.onnx.data", all_fp4=True)
    (tmp_path / "sub").mkdir()
    report = str(tmp_path / "in.onnx.data") if flag == "--report" else str(tmp_path / "sub" / ".." / "in.onnx.data")
    before = _sha(tmp_path)
    assert main(["convert", str(path), "-o", str(tmp_path / "o.onnx"), "--report", report]) == 2
    assert "refusing to write over the input" in capsys.readouterr().err
    assert _sha(tmp_path) == before


def test_cli_counts_constant_data_files_among_its_inputs(tmp_path, capsys):
    proto = _constant_model("function")
    _externalize(_constant_tensor(proto), tmp_path, "c.bin")
    onnx.save(proto, tmp_path / "m.onnx")
    before = _sha(tmp_path)
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"), "--report",
                 str(tmp_path / "c.bin")]) == 2
    assert "refusing to write over the input" in capsys.readouterr().err
    assert _sha(tmp_path) == before


def test_api_output_through_a_symlink_out_of_its_folder_is_refused(tmp_path):
    """The Python API writes through :func:`fp4pass.onnx.loading.save`, which has no CLI check before it: the
    rename itself must refuse to replace a symlink that leads elsewhere."""
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere.onnx").write_bytes(b"not ours")
    (tmp_path / "out" / "m.onnx").symlink_to(tmp_path / "elsewhere.onnx")
    with pytest.raises(UsageError, match="outside the output's folder"):
        fp4pass.onnx.convert(B.linear_model(), output=tmp_path / "out" / "m.onnx")
    assert (tmp_path / "out" / "m.onnx").is_symlink()
    assert (tmp_path / "elsewhere.onnx").read_bytes() == b"not ours"
    assert os.listdir(tmp_path / "out") == ["m.onnx"]


@pytest.mark.parametrize("given_inputs", [False, True])
def test_save_refuses_to_write_over_the_data_its_model_reads(tmp_path, given_inputs):
    """:func:`fp4pass.onnx.loading.save` on its own (the fx exporter and the example builders call it): the
    data file a model's tensors still read, or one named among ``inputs``, is never the output's data file."""
    path = _external_file_model(tmp_path, "a.onnx", "b.onnx.data", all_fp4=True)
    model = loading.load(path).model
    inputs = (str(tmp_path / "b.onnx.data"),) if given_inputs else ()
    if given_inputs:  # the model no longer reads the file (its weights were rewritten): only ``inputs`` know
        ir.external_data.load_to_model(model)
    before = _sha(tmp_path)
    with pytest.raises(UsageError, match="refusing to write over the input's external data"):
        loading.save(model, tmp_path / "b.onnx", external_data="always", inputs=inputs)
    assert _sha(tmp_path) == before


def test_save_renames_the_data_in_before_the_model_that_names_it(tmp_path, monkeypatch):
    """A crash between the two renames must never leave a model whose data file is missing or stale: each
    file is fsynced before its rename into the output folder, the data file lands first, the model last, each
    rename followed by the folder's fsync. (What onnx_ir does inside its staging folder is not counted.)"""
    from fp4pass import io as fio

    out = tmp_path / "out"
    out.mkdir()
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    assert loading.save(ir.serde.deserialize_model(B.linear_model()), out / "m.onnx", external_data="always")
    staged = [e for e in events if e[0] == "fsync" and Path(e[1]).name.startswith("m.onnx")]
    assert [Path(e[1]).name for e in staged] == ["m.onnx.data", "m.onnx"], events
    assert all(Path(e[1]).parent.name.startswith(fio.TMP_PREFIX) for e in staged), events
    into_out = [(kind, Path(p).name if Path(p).parent == out else p) for kind, p in events
                if Path(p).parent == out or Path(p) == out]
    assert into_out == [("replace", "m.onnx.data"), ("fsync", str(out)), ("replace", "m.onnx"),
                        ("fsync", str(out))], events
    # each staged file's fsync comes before its own rename
    assert events.index(staged[0]) < events.index(("replace", str(out / "m.onnx.data")))
    assert events.index(staged[1]) < events.index(("replace", str(out / "m.onnx")))
    assert sorted(os.listdir(out)) == ["m.onnx", "m.onnx.data"]
    reread = onnx.load(str(out / "m.onnx"))
    assert {t.name for t in reread.graph.initializer} == {t.name for t in B.linear_model().graph.initializer}


def test_each_kind_of_model_is_named_in_its_messages_and_given_back_as_it_came(tmp_path):
    """A model that is not a file is named by its kind (``<proto>``, ``<ir>``, ``<gs>``) where a path would
    be, and :func:`~fp4pass.onnx.loading.to_kind` gives the rewritten model back as the kind it came in."""
    gs = pytest.importorskip("onnx_graphsurgeon")
    model_dir = tmp_path / "model"
    proto = _fp4_model_with_external_weight(model_dir, "w.bin")
    made = {"proto": lambda: proto, "ir": lambda: ir.serde.deserialize_model(proto),
            "gs": lambda: gs.import_onnx(proto)}
    back = {"proto": onnx.ModelProto, "ir": ir.Model, "gs": gs.Graph}
    for kind, make in made.items():
        with pytest.raises(UnsafeExternalDataError) as raised:
            loading.load(make())
        assert str(raised.value).startswith(f"<{kind}>: initializer 'W' is stored in external data 'w.bin', "
                                            "but the model has no folder"), (kind, raised.value)
        loaded = loading.load(make(), base_dir=model_dir)
        assert loaded.kind == kind and loaded.path is None
        assert isinstance(loading.to_kind(loaded.model, loaded.kind), back[kind])
    bad = B.linear_model()
    bad.graph.initializer[0].dims[0] = -1
    with pytest.raises(ModelError) as raised:
        loading.load(bad)
    assert str(raised.value).startswith(f"model: graph: initializer {bad.graph.initializer[0].name!r}: negative dim")


def test_a_model_proto_onnx_ir_cannot_read_is_one_line_naming_it(tmp_path):
    proto = B.linear_model()
    attr = proto.graph.node[0].attribute.add()
    attr.name, attr.type = "sparse", onnx.AttributeProto.SPARSE_TENSOR  # no sparse tensor in it
    with pytest.raises(ModelError) as raised:
        loading.load(proto)
    assert str(raised.value).startswith("model: malformed model (SerdeError: ")
    assert "\n" not in str(raised.value)


def test_what_is_not_a_model_or_a_folder_is_named(tmp_path):
    with pytest.raises(UsageError) as raised:
        loading.load(b"model bytes")
    assert str(raised.value) == ("cannot read a model from bytes; give a path, onnx.ModelProto, onnx_ir.Model or "
                                 "onnx_graphsurgeon.Graph")
    (tmp_path / "f").write_bytes(b"")
    for not_a_folder in (tmp_path / "f", tmp_path / "missing"):
        with pytest.raises(UsageError) as raised:
            loading.load(B.linear_model(), base_dir=not_a_folder)
        assert str(raised.value) == f"base_dir {str(not_a_folder)!r}: not a folder"


def test_an_ir_model_whose_tensors_live_in_different_folders_reads_each_from_its_own(tmp_path):
    """onnx_ir keeps a folder per tensor: each external tensor is checked against its own folder, and a
    refusal names the model's kind, the tensor and its location."""
    proto = B.linear_model()
    names = [t.name for t in proto.graph.initializer][:2]
    for name, folder in zip(names, ("one", "two")):
        tensor = next(t for t in proto.graph.initializer if t.name == name)
        _externalize(tensor, tmp_path / folder, f"{name}.bin")
    model = ir.serde.deserialize_model(proto)
    for name, folder in zip(names, ("one", "two")):
        model.graph.initializers[name].const_value.base_dir = str(tmp_path / folder)
    assert loading.load(model).kind == "ir"
    model.graph.initializers[names[1]].const_value.base_dir = str(tmp_path / "one")
    with pytest.raises(UnsafeExternalDataError) as raised:
        loading.load(model)
    assert str(raised.value) == f"<ir>: tensor {names[1]!r} external data '{names[1]}.bin': data file not found"
    secret = _secret(tmp_path)
    (tmp_path / "model").mkdir()
    escaping = _fp4_model_with_external_weight(tmp_path / "model", "../secret.bin", data_file=secret)
    with pytest.raises(UnsafeExternalDataError) as raised:
        loading.load(escaping, base_dir=tmp_path / "model")
    assert str(raised.value) == ("<proto>: tensor 'W' external data '../secret.bin' leaves the model's folder; "
                                 "refusing to read it")
