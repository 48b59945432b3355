"""Fuzz campaign over checkpoint folders: damaged shards, headers that lie, configs and indexes of every wrong
kind, special files where files belong; ``fp4pass inspect`` and ``fp4pass convert`` on each case.

Invariants of every case: exit 0, 1 or 2 (never 3, never a traceback); the source folder unchanged, byte for
byte; on a non-zero exit no OUT_DIR and no temporary left beside it; with exit 0 every output shard opens with
the ``safetensors`` package (a reader fp4pass did not write) and its tensors have the dtypes and shapes the
header promises. 24 cases run by default, 300 under ``-m slow`` (``FP4PASS_CKPT_FUZZ_CASES`` /
``FP4PASS_CKPT_FUZZ_SLOW_CASES`` change the counts).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import struct
from pathlib import Path

import pytest

from fp4pass.cli import main
from fp4pass.examples.checkpoints import build_checkpoint

safetensors = pytest.importorskip("safetensors")

#: DeepSeek-V4's default output (its FP8 config with NVFP4 experts) is W4A4 only: convert needs an input scale
W4A4 = ["--input-scale", "0.0123"]
FORMS = {"gpt-oss": "modelopt", "compressed-tensors": "compressed-tensors", "deepseek": "modelopt"}
DEFAULT_CASES = int(os.environ.get("FP4PASS_CKPT_FUZZ_CASES", "24"))
SLOW_CASES = int(os.environ.get("FP4PASS_CKPT_FUZZ_SLOW_CASES", "300"))


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _header(path: Path) -> tuple[dict, int]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), n


def _write_header(path: Path, header: dict) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    body = data[8 + n:]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def _tensor_names(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


# -- the mutations: each changes the folder in one way a real checkpoint can be wrong -------------------------


def m_flip_header_byte(rng, folder):
    path = rng.choice(_shards(folder))
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    i = rng.randrange(0, 8 + n)
    data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def m_truncate_shard(rng, folder):
    path = rng.choice(_shards(folder))
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(0, len(data))])


def m_flip_data_byte(rng, folder):
    """A random byte of the tensor data: a code, a scale (maybe E8M0 255), a bf16 weight."""
    path = rng.choice(_shards(folder))
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    if len(data) > 8 + n:
        i = rng.randrange(8 + n, len(data))
        data[i] = rng.choice([255, 0, data[i] ^ 0x80])
        path.write_bytes(bytes(data))


def _scale_names(header: dict) -> list[str]:
    return [k for k in _tensor_names(header) if k.endswith(("_scales", ".weight_scale", ".scale"))]


def m_e8m0_nan(rng, folder):
    path = rng.choice([p for p in _shards(folder) if _scale_names(_header(p)[0])])
    header, n = _header(path)
    scales = _scale_names(header)
    entry = header[rng.choice(scales)]
    start, end = entry["data_offsets"]
    data = bytearray(path.read_bytes())
    data[8 + n + rng.randrange(start, end)] = 255
    path.write_bytes(bytes(data))


def m_lying_header(rng, folder):
    path = rng.choice(_shards(folder))
    header, _ = _header(path)
    name = rng.choice(_tensor_names(header))
    entry = header[name]
    choice = rng.randrange(6)
    if choice == 0:
        entry["dtype"] = rng.choice(["F8_E8M0", "U8", "I8", "BF16", "F32", "F64", "XYZ", "", 7, ["U8"], None])
    elif choice == 1:
        entry["shape"] = [d * rng.choice([2, 3]) if d else 1 for d in entry["shape"]] or [2]
    elif choice == 2:
        entry["shape"] = rng.choice([[], [-1, 4], [2**62, 2**62], "x", [0]])
    elif choice == 3:
        start, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[end, start], [start, end + 64], [start + 1, end], [0, 2**62], [-8, end]])
    elif choice == 4:
        del header[name]  # the tensor vanishes (a missing scales tensor, a missing bias)
    else:
        header[name + rng.choice(["_x", ".bak", ""])] = dict(entry)  # a duplicate or extra entry
    _write_header(path, header)


def m_rename_tensor(rng, folder):
    """A scales tensor under another name (so its codes have none), or codes named like a different form."""
    path = rng.choice(_shards(folder))
    header, _ = _header(path)
    name = rng.choice(_tensor_names(header))
    new = name.replace("_scales", "_scale").replace("weight_scale", "weight_scales").replace(".scale", ".scales")
    if new == name:
        new = name.replace("experts", "expert")
    header[new] = header.pop(name)
    _write_header(path, header)


def m_config(rng, folder):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    choice = rng.randrange(6)
    if choice == 0:
        path.write_text(rng.choice(["", "{", "[]", "null", "\"text\"", "{\"a\": 1, \"a\": 2}", "1" * 5000]))
    elif choice == 1:
        key = rng.choice(list(config))
        config[key] = rng.choice([None, "x", -1, 0, [], {}, 1e308, True])
        path.write_text(json.dumps(config))
    elif choice == 2:
        config["quantization_config"] = rng.choice([None, "mxfp4", [], {"quant_method": "fp8"}, {"quant_method": 3}])
        path.write_text(json.dumps(config))
    elif choice == 3:
        path.unlink()
    elif choice == 4:
        path.unlink()
        path.symlink_to("/dev/zero")
    else:
        path.unlink()
        os.mkfifo(path)


def m_index(rng, folder):
    index = folder / "model.safetensors.index.json"
    shards = _shards(folder)
    if not index.exists():
        weight_map = {}
        for shard in shards:
            header, _ = _header(shard)
            weight_map.update({k: shard.name for k in _tensor_names(header)})
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    data = json.loads(index.read_text())
    weight_map = data["weight_map"]
    name = rng.choice(list(weight_map))
    choice = rng.randrange(5)
    if choice == 0:
        weight_map[name] = rng.choice(["../outside.safetensors", "/etc/passwd", "missing.safetensors", "", 3])
    elif choice == 1:
        del weight_map[name]
    elif choice == 2:
        weight_map["ghost.weight"] = shards[0].name
    elif choice == 3:
        other = [s.name for s in shards if s.name != weight_map[name]]
        if other:
            weight_map[name] = rng.choice(other)
    else:
        index.write_text(rng.choice(["{", "[]", json.dumps({"weight_map": []}), json.dumps({"metadata": 1})]))
        return
    index.write_text(json.dumps(data))


def m_special_file(rng, folder):
    """A FIFO or a link to a device among the files that are copied (a tokenizer file, a shard)."""
    path = rng.choice([p for p in folder.iterdir() if p.is_file()])
    path.unlink()
    if rng.random() < 0.5:
        os.mkfifo(path)
    else:
        path.symlink_to(rng.choice(["/dev/zero", "/dev/null"]))


MUTATIONS = [m_flip_header_byte, m_truncate_shard, m_flip_data_byte, m_e8m0_nan, m_lying_header, m_rename_tensor,
             m_config, m_index, m_special_file]


def _snapshot(folder: Path) -> dict:
    found = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path))
        elif path.is_fifo():
            found[rel] = ("fifo",)
        elif path.is_file():
            found[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return found


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _run(argv, capsys, seconds=120):
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        code = main(argv)
    except _Timeout:
        pytest.fail(f"{argv} did not finish within {seconds} s (blocked on a special file?)")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, capsys.readouterr().err


def _case(seed: int, root: Path, capsys) -> None:
    rng = random.Random(seed)
    form = rng.choice(sorted(FORMS))
    src = build_checkpoint(root / "src", form, layers=1, experts=2, hidden=64, intermediate=32, seed=seed,
                           dense=rng.random() < 0.3, shard_bytes=rng.choice([None, 20_000]))
    mutation = rng.choice(MUTATIONS)
    mutation(rng, src)
    before = _snapshot(src)
    out = root / "out"
    fmt = FORMS[form]
    for argv in (["inspect", str(src), "--json"],
                 ["convert", str(src), "-o", str(out), "--format", fmt, *(["--check"] if rng.random() < 0.5 else []),
                  *(["--input-scale", "1.0"] if rng.random() < 0.5 else [])]):
        code, err = _run(argv, capsys)
        label = f"seed {seed} ({form}, {mutation.__name__}): {' '.join(argv[:1])}"
        assert code in (0, 1, 2), f"{label}: exit {code}: {err[-800:]}"
        assert "Traceback" not in err, f"{label}: {err[-800:]}"
        if code != 0:
            assert err.strip(), f"{label}: exit {code} with nothing said"
        assert _snapshot(src) == before, f"{label}: the source folder changed"
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".fp4pass-tmp-")]
        assert leftovers == [], f"{label}: temporaries left: {leftovers}"
        if argv[0] == "convert":
            if code != 0:
                assert not out.exists(), f"{label}: exit {code} left {out}"
            else:
                from safetensors import safe_open

                for shard in _shards(out):
                    header, _ = _header(shard)
                    with safe_open(str(shard), "pt") as f:
                        for name in f.keys():
                            assert list(f.get_slice(name).get_shape()) == header[name]["shape"], f"{label}: {name}"


@pytest.mark.parametrize("seed", range(DEFAULT_CASES))
def test_checkpoint_fuzz_default(seed, tmp_path, capsys):
    _case(seed, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(DEFAULT_CASES, DEFAULT_CASES + SLOW_CASES))
def test_checkpoint_fuzz_slow(seed, tmp_path, capsys):
    _case(seed, tmp_path, capsys)


@pytest.mark.parametrize("dtype", [["U8"], None, 7, {"U8": 1}, "u8", ""])
def test_a_header_dtype_of_any_json_kind_is_exit_2(dtype, tmp_path, capsys):
    """A regression the campaign found: a dtype that is a JSON list (unhashable) was exit 3."""
    src = build_checkpoint(tmp_path / "src", "deepseek", layers=1, experts=1, hidden=64, intermediate=32)
    path = _shards(src)[0]
    header, _ = _header(path)
    header[next(k for k in _tensor_names(header) if k.endswith(".scale"))]["dtype"] = dtype
    _write_header(path, header)
    code, err = _run(["convert", str(src), "-o", str(tmp_path / "out"), "--format", "modelopt"], capsys)
    assert code == 2 and "unknown dtype" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


# -- hostile folders and flags, class by class ---------------------------------------------------------------
#
# Each class below states one rule of docs/bad-input.md; every case of a class holds the invariants of _case:
# exit 2 with one line that names the file, link, tensor or flag, no traceback, the source unchanged, and no
# OUT_DIR and no temporary left.


def _small(root: Path, form: str = "deepseek", **kw) -> Path:
    return build_checkpoint(root / "src", form, layers=1, experts=2, hidden=64, intermediate=32, **kw)


def _refused(root: Path, argv: list[str], capsys, *needles: str, out: Path | None = None) -> str:
    """Run ``argv``; exit 2, one line naming every one of ``needles``, nothing left behind."""
    src = Path(argv[1])
    before = _snapshot(src) if src.is_dir() else None
    code, err = _run(argv, capsys)
    assert code == 2, f"{argv}: exit {code}: {err[-800:]}"
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    if before is not None:
        assert _snapshot(src) == before
    if out is not None:
        assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".fp4pass-tmp-")] if out else True
    return err


def _hf_cache(root: Path, form: str = "deepseek") -> Path:
    """A Hugging Face cache repository: snapshots/<rev>/FILE -> ../../blobs/<hash>, as huggingface_hub lays it."""
    built = build_checkpoint(root / "built", form, layers=1, experts=2, hidden=64, intermediate=32)
    (built / "tokenizer.model").write_bytes(b"tokenizer bytes")
    repo = root / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(built.iterdir()):
        blob = hashlib.sha256(path.read_bytes()).hexdigest()
        os.replace(path, blobs / blob)
        (snapshot / path.name).symlink_to(f"../../blobs/{blob}")
    return snapshot


LINKED_ROLES = ["config.json", "model.safetensors.index.json", "shard", "tokenizer.model", "chat_template.jinja"]


def _link_out(src: Path, role: str, target: Path) -> Path:
    """Replace the file of ``role`` in ``src`` with a symlink to ``target`` (a copy of it, or a secret)."""
    if role == "shard":
        role = _shards(src)[0].name
    link = src / role
    if link.exists() and not target.exists():
        target.write_bytes(link.read_bytes())
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    return link


@pytest.mark.parametrize("role", LINKED_ROLES)
@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_symlink_out_of_the_folder_is_refused_naming_link_and_target(role, command, tmp_path, capsys):
    """Links out of the folder (a cloned repository's tokenizer.model -> /etc/shadow) are refused for every
    file the folder is read through, whatever the file holds: the link and its target are named."""
    src = _small(tmp_path, shard_bytes=20_000)
    outside = tmp_path / "outside"
    outside.mkdir()
    link = _link_out(src, role, outside / "secret")
    if not (outside / "secret").exists():
        (outside / "secret").write_text("HF_TOKEN=hf_secret")
    out = tmp_path / "out"
    argv = ["inspect", str(src)] if command == "inspect" else ["convert", str(src), "-o", str(out)]
    _refused(tmp_path, argv, capsys, str(link), str(outside / "secret"), "--follow-symlinks", out=out)


@pytest.mark.parametrize("role", LINKED_ROLES)
def test_follow_symlinks_reads_them_and_copies_exactly(role, tmp_path, capsys):
    src = _small(tmp_path, shard_bytes=20_000)
    outside = tmp_path / "outside"
    outside.mkdir()
    _link_out(src, role, outside / "file")
    if not (outside / "file").exists():
        (outside / "file").write_text("{{ messages }}")
    out = tmp_path / "out"
    code, err = _run(["convert", str(src), "-o", str(out), "--follow-symlinks", *W4A4], capsys)
    assert code == 0, err
    if role in ("tokenizer.model", "chat_template.jinja"):
        assert (out / role).read_bytes() == (outside / "file").read_bytes() and not (out / role).is_symlink()


@pytest.mark.parametrize("secret", ["/proc/self/environ", "/proc/self/pagemap", "/sys/kernel/mm/transparent_hugepage/enabled"])
@pytest.mark.parametrize("role", ["config.json", "tokenizer.model"])
def test_pseudo_files_are_never_read_even_through_follow_symlinks(secret, role, tmp_path, capsys, monkeypatch):
    if not os.path.exists(secret):
        pytest.skip(f"{secret}: not on this system")
    monkeypatch.setenv("HF_TOKEN", "hf_must_not_leak")
    src = _small(tmp_path)
    link = src / role
    link.unlink(missing_ok=True)
    link.symlink_to(secret)
    out = tmp_path / "out"
    _refused(tmp_path, ["convert", str(src), "-o", str(out), "--follow-symlinks"], capsys, str(link),
             "pseudo file system", out=out)


def test_a_hugging_face_cache_snapshot_reads_its_blobs(tmp_path, capsys):
    """The cache's own layout, snapshots/<rev>/FILE -> ../../blobs/<hash>, is read without any flag; a blob
    of another repository is not."""
    snapshot = _hf_cache(tmp_path)
    out = tmp_path / "out"
    code, err = _run(["convert", str(snapshot), "-o", str(out), *W4A4], capsys)
    assert code == 0, err
    assert (out / "tokenizer.model").read_bytes() == b"tokenizer bytes"
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "feed").write_bytes(b"another repository's file")
    link = snapshot / "tokenizer.model"
    link.unlink()
    link.symlink_to(other / "feed")
    _refused(tmp_path, ["convert", str(snapshot), "-o", str(tmp_path / "out2")], capsys, str(link),
             str(other / "feed"), out=tmp_path / "out2")


def test_a_symlink_inside_the_folder_is_read(tmp_path, capsys):
    src = _small(tmp_path)
    (src / "real_template.jinja").write_text("{{ x }}")
    (src / "chat_template.jinja").unlink(missing_ok=True)
    (src / "chat_template.jinja").symlink_to("real_template.jinja")
    out = tmp_path / "out"
    code, err = _run(["convert", str(src), "-o", str(out), *W4A4], capsys)
    assert code == 0, err
    assert (out / "chat_template.jinja").read_text() == "{{ x }}"


def test_a_file_whose_content_is_not_its_size_is_refused(tmp_path, monkeypatch):
    """Exactly st_size bytes are read or copied, then the file must end: /proc/self/pagemap says 0 bytes and
    reads without end (the pseudo file system check is switched off here to reach this rule)."""
    from fp4pass import io as fio

    monkeypatch.setattr(fio.inputs, "pseudo_filesystem", lambda info: None)
    with pytest.raises(fio.UsageError, match=r"holds more than the 0 bytes its size says"):
        fio.copy_regular_file("/proc/self/environ", tmp_path / "copy")
    with pytest.raises(fio.UsageError, match=r"holds more than the 0 bytes its size says"):
        fio.read_regular_file("/proc/self/environ", 1 << 20)


def _zero_size_gpt_oss(root: Path, shape: tuple[int, int, int]) -> Path:
    import torch
    from safetensors.torch import save_file

    e, n, kb = shape
    src = root / "src"
    src.mkdir()
    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros((e, n, kb, 16), dtype=torch.uint8),
               "model.layers.0.mlp.experts.gate_up_proj_scales": torch.full((e, n, kb), 120, dtype=torch.uint8),
               "model.layers.0.mlp.experts.gate_up_proj_bias": torch.zeros((e, n), dtype=torch.bfloat16)},
              str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "gpt_oss",
                                                 "quantization_config": {"quant_method": "mxfp4"}}))
    return src


def _surrogate_name(src: Path) -> None:
    path = _shards(src)[0]
    header, _ = _header(path)
    name = next(k for k in _tensor_names(header) if not k.endswith((".scale", "_scales", ".weight_scale")))
    header[name + "\ud800"] = header.pop(name)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = json.dumps(header).encode()  # ensure_ascii: the surrogate as the escape \ud800, as a hostile writer
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


def _crash_case(kind: str, root: Path) -> tuple[Path, list[str], list[str]]:
    """(source, extra flags, what the error line must name) for each input that used to crash."""
    if kind.startswith("zero-"):
        shape = {"zero-experts": (0, 4, 2), "zero-rows": (2, 0, 2), "zero-blocks": (2, 4, 0)}[kind]
        return _zero_size_gpt_oss(root, shape), [], ["gate_up_proj_blocks", "holds no element"]
    src = _small(root)
    if kind in ("config-nan", "config-infinity"):
        config = json.loads((src / "config.json").read_text())
        config["rope_theta"] = float("nan") if kind == "config-nan" else float("inf")
        (src / "config.json").write_text(json.dumps(config))  # Python writes NaN / Infinity
        return src, [], ["config.json", "NaN" if kind == "config-nan" else "Infinity"]
    if kind == "surrogate-name":
        _surrogate_name(src)
        return src, [], [_shards(src)[0].name, "lone surrogate"]
    raise AssertionError(kind)


CRASHES = ["zero-experts", "zero-rows", "zero-blocks", "config-nan", "config-infinity", "surrogate-name"]


@pytest.mark.parametrize("kind", CRASHES)
@pytest.mark.parametrize("command", ["inspect", "convert", "convert --quiet --check"])
def test_inputs_that_crashed_are_one_line_exit_2(kind, command, tmp_path, capsys):
    src, extra, needles = _crash_case(kind, tmp_path)
    out = tmp_path / "out"
    words = command.split()
    argv = [*words[1:], "inspect", str(src)] if words[0] == "inspect" else [
        *(["--quiet"] if "--quiet" in words else []), "convert", str(src), "-o", str(out),
        *(["--check"] if "--check" in words else [])]
    if argv[0] == "--quiet":
        argv = argv[1:2] + argv[2:3] + ["--quiet"] + argv[3:]
    _refused(tmp_path, argv, capsys, *needles, out=out if words[0] == "convert" else None)


@pytest.mark.parametrize("flags, needle", [
    (["--max-shard-size", "inf"], "--max-shard-size"), (["--max-shard-size", "1e400"], "--max-shard-size"),
    (["--max-shard-size", "nan"], "--max-shard-size"), (["--threads", "20000"], "--threads"),
    (["--threads", "100000"], "--threads"), (["--input-scale", "1e300"], "--input-scale"),
    (["--input-scale", "1e-46"], "--input-scale"), (["--inputs", "x.npz"], "--inputs"),
    (["--shape", "x=1"], "--shape"), (["--past-length", "3"], "--past-length")])
def test_flags_out_of_range_or_for_onnx_only_are_refused_on_folders(flags, needle, tmp_path, capsys):
    """Sizes past float range, more threads than the machine can start, input scales float32 turns into inf
    or 0 (the range SCALES.json holds its values to), and ONNX-only flags: exit 2 naming the flag, before any
    work."""
    src = _small(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) if needle in ("--max-shard-size", "--threads") else _no_exit() as exited:
        code, err = _run(["convert", str(src), "-o", str(out), *flags], capsys)
    if exited is not None and hasattr(exited, "value"):
        code, err = exited.value.code, capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("value", [1e300, 1e-46, float("inf")])
def test_the_library_holds_input_scale_to_the_scales_json_range(value, tmp_path):
    from fp4pass.checkpoint import CheckpointError, convert

    with pytest.raises(CheckpointError, match="input_scale"):
        convert(_small(tmp_path), tmp_path / "out", input_scale=value)
    assert not (tmp_path / "out").exists()


def test_threads_past_the_cap_are_refused_on_onnx_models_too(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["convert", "models/moe.onnx", "-o", str(tmp_path / "o.onnx"), "--threads", "100000"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--threads" in err and "Traceback" not in err


class _no_exit:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- the rename of OUT_DIR is the last step; nothing after a failure -----------------------------------------


def _lossy_at_254(src: Path) -> None:
    """Scales alternating E8M0 254 and 230 (a spread of 24: lossy), values up to 6 * 2^127."""
    for path in _shards(src):
        header, n = _header(path)
        data = bytearray(path.read_bytes())
        for name in _scale_names(header):
            begin, end = header[name]["data_offsets"]
            data[8 + n + begin:8 + n + end] = bytes(254 if i % 2 else 230 for i in range(end - begin))
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("form", ["deepseek", "gpt-oss"])
def test_an_snr_that_is_not_finite_is_null_with_a_note(form, tmp_path, capsys):
    src = _small(tmp_path, form)
    _lossy_at_254(src)
    out, report = tmp_path / "out", tmp_path / "report.json"
    code, err = _run(["convert", str(src), "-o", str(out), "--report", str(report), *W4A4], capsys)
    assert code == 0, err
    data = json.loads(report.read_text())  # strict JSON: no NaN
    assert data["tensors"][0]["snr_db"] is None and "tensors[0].snr_db" in data["not_finite"]["figures"]
    assert "float32" in data["not_finite"]["why"]


def _sigterm_when(monkeypatch, module, name: str, after=lambda *a, **k: True):
    """Send SIGTERM to this process right after ``module.name`` is called (when ``after`` says so)."""
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        result = real(*args, **kwargs)
        if after(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize("moment", ["after-the-rename", "after-convert-returned"])
def test_sigterm_after_the_rename_takes_out_dir_back_out(moment, tmp_path, capsys, monkeypatch):
    import fp4pass.checkpoint as command
    from fp4pass import io as fio

    src = _small(tmp_path)
    out, report = tmp_path / "out", tmp_path / "report.json"
    if moment == "after-the-rename":  # the folder's fsync that follows os.replace
        _sigterm_when(monkeypatch, fio.folders, "fsync_folder", after=lambda folder: Path(folder) == tmp_path
                      and out.exists())
    else:
        _sigterm_when(monkeypatch, command, "summary_line")
    code, err = _run(["convert", str(src), "-o", str(out), "--report", str(report), *W4A4], capsys)
    assert code == 143 and "terminated" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_an_empty_out_dir_given_is_an_empty_folder_again_after_a_signal(tmp_path, capsys, monkeypatch):
    import fp4pass.checkpoint as command

    src = _small(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    _sigterm_when(monkeypatch, command, "summary_line")
    code, err = _run(["convert", str(src), "-o", str(out), *W4A4], capsys)
    assert code == 143 and out.is_dir() and list(out.iterdir()) == []


def test_a_report_that_cannot_be_written_is_exit_2_naming_it_and_no_out_dir(tmp_path, capsys, monkeypatch):
    """A full file system under --report: the report is written before OUT_DIR is renamed into place."""
    from fp4pass import io as fio

    real = fio.finish

    def full(tmp, target, kind=fio.RESULT):
        if Path(target).name == "report.json":
            raise OSError(28, "No space left on device")
        return real(tmp, target, kind)

    monkeypatch.setattr(fio.outputs, "finish", full)
    src = _small(tmp_path)
    out, report = tmp_path / "out", tmp_path / "report.json"
    _refused(tmp_path, ["convert", str(src), "-o", str(out), "--report", str(report), *W4A4], capsys, str(report),
             "No space left on device", out=out)
    assert not report.exists()


@pytest.mark.parametrize("link", ["out", "out/report.json"])
def test_a_report_linked_into_out_dir_is_refused_before_any_work(link, tmp_path, capsys, monkeypatch):
    from fp4pass.checkpoint import run

    monkeypatch.setattr(run, "Catalog", None)  # any work would fail with another message
    src = _small(tmp_path)
    out, report = tmp_path / "out", tmp_path / "report.json"
    report.symlink_to(tmp_path / link)
    _refused(tmp_path, ["convert", str(src), "-o", str(out), "--report", str(report)], capsys, "--report",
             "OUT_DIR", out=out)


# -- the stale sweep never removes an input --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["checkpoint folder", "onnx model"])
def test_an_input_named_like_a_dead_runs_temporary_is_never_removed(kind, tmp_path, capsys):
    from fp4pass.io import TMP_PREFIX, host_token

    proc = __import__("subprocess").run([__import__("sys").executable, "-c", "import os; print(os.getpid())"],
                                        capture_output=True, text=True)
    name = f"{TMP_PREFIX}{int(proc.stdout)}-h{host_token()}-abcd-salvaged"
    if kind == "checkpoint folder":
        src = build_checkpoint(tmp_path / name, "deepseek", layers=1, experts=2, hidden=64, intermediate=32)
        argv = ["convert", str(src), "-o", str(tmp_path / "out"), *W4A4]
    else:
        src = tmp_path / (name + ".onnx")
        src.write_bytes(Path("models/moe.onnx").read_bytes())
        argv = ["convert", str(src), "-o", str(tmp_path / "out.onnx")]
    before = _snapshot(src) if src.is_dir() else src.read_bytes()
    code, err = _run(argv, capsys)
    assert code == 0, err
    assert (_snapshot(src) if src.is_dir() else src.read_bytes()) == before
    code, err = _run(["clean", str(tmp_path), "--older-than", "0"], capsys)
    assert code == 0 and src.exists()


# -- --check where compressed-tensors cannot hold the values ---------------------------------------------------


def _all_scales(src: Path, code: int) -> None:
    for path in _shards(src):
        header, n = _header(path)
        data = bytearray(path.read_bytes())
        for name in _scale_names(header):
            begin, end = header[name]["data_offsets"]
            data[8 + n + begin:8 + n + end] = bytes([code]) * (end - begin)
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("form, code", [("compressed-tensors", 254), ("deepseek", 0), ("gpt-oss", 254)])
def test_check_passes_bit_exact_conversions_at_the_ends_of_the_e8m0_range(form, code, tmp_path, capsys):
    """All codes 254 (values to 6 * 2^127) or all 0 (down to 2^-128): the conversion is exact, compressed-
    tensors' float32/bf16 decode is not; --check decodes those experts in float64 and names them."""
    pytest.importorskip("compressed_tensors")
    src = _small(tmp_path, form)
    _all_scales(src, code)
    out, report = tmp_path / "out", tmp_path / "report.json"
    code_, err = _run(["convert", str(src), "-o", str(out), "--format", FORMS[form], "--check",
                       "--report", str(report), *(W4A4 if form == "deepseek" else [])], capsys)
    assert code_ == 0, err
    check = json.loads(report.read_text())["check"]
    assert check["passed"] and check["experts_identical"] == check["experts_checked"] > 0
    assert len(check["decoded_in_float64"]) == check["experts_checked"]
    assert "decoded in float64" in err


def test_check_float64_decoder_agrees_with_compressed_tensors_where_both_hold(tmp_path):
    """The float64 decoder (fp4pass.checkpoint.check.decode_nvfp4) against compressed-tensors' reader on values
    both hold: the same numbers."""
    pytest.importorskip("compressed_tensors")
    import numpy as np
    import torch

    from fp4pass.checkpoint.check import _Reader, decode_nvfp4

    rng = np.random.default_rng(5)
    packed = torch.from_numpy(rng.integers(0, 256, (8, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(0x20, 0x60, (8, 2), dtype=np.uint8)).view(torch.float8_e4m3fn)
    ours = decode_nvfp4(packed.numpy(), scales.view(torch.uint8).numpy(), 0.25)
    theirs = _Reader().decode(packed, scales, 4.0)
    assert np.array_equal(ours, theirs)


# -- low: bind mounts, many shards, error lines that name their file ---------------------------------------------


def _in_private_mount_namespace(script: str) -> __import__("subprocess").CompletedProcess:
    import shutil
    import subprocess

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("no private mount namespace here (unshare -m)")
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)


def test_out_dir_inside_the_source_through_a_bind_mount_is_refused(tmp_path):
    """Paths cannot see a bind mount of the source folder; device and inode numbers can."""
    import sys

    src = _small(tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    before = _snapshot(src)
    proc = _in_private_mount_namespace(
        f"mount --bind {src} {mnt} || exit 99; {sys.executable} -m fp4pass convert {src} -o {mnt}/out")
    if proc.returncode == 99:
        pytest.skip("bind mounts are not allowed here")
    assert proc.returncode == 2 and "is inside" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert _snapshot(src) == before


def test_a_checkpoint_of_more_shards_than_open_files_converts(tmp_path):
    """More shards than the open-file limit (300 under 256, as 1,500 under the usual 1024): shards are opened
    only while they are read."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import save_file

    src = _small(tmp_path)
    (src / "model.safetensors").rename(src / "model-main.safetensors")
    header, _ = _header(src / "model-main.safetensors")
    weight_map = {name: "model-main.safetensors" for name in _tensor_names(header)}
    for i in range(300):
        name = f"extra-{i:05d}.safetensors"
        save_file({f"extra.{i}": torch.full((2,), i, dtype=torch.int16)}, str(src / name))
        weight_map[f"extra.{i}"] = name
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    script = ("import resource, sys\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
              "from fp4pass.cli import main\n"
              f"code = main(['inspect', {str(src)!r}, '--json'])\n"
              f"sys.exit(code or main(['convert', {str(src)!r}, '-o', {str(tmp_path / 'out')!r}, *{W4A4!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from safetensors import safe_open

    with safe_open(str(next((tmp_path / "out").glob("*.safetensors"))), "pt") as f:
        assert f.get_tensor("extra.299").tolist() == [299, 299]


def test_the_examples_builder_into_an_existing_folder_is_one_line(tmp_path, capsys):
    from fp4pass.examples.checkpoints import main as build

    argv = [str(tmp_path / "ex"), "--layers", "1", "--experts", "1"]
    assert build(argv) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        build(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1 and "exists" in err


def test_a_config_past_its_limit_is_refused_without_reading_it(tmp_path, capsys):
    from fp4pass.safetensors.catalog import CONFIG_LIMIT

    src = _small(tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["padding"] = "x" * CONFIG_LIMIT
    (src / "config.json").write_text(json.dumps(config))
    _refused(tmp_path, ["inspect", str(src)], capsys, "config.json", f"at most {CONFIG_LIMIT}")


def test_a_failed_copy_names_the_source_shard_and_the_tensor(tmp_path, capsys, monkeypatch):
    """EIO while a tensor is copied file to file: the line names the source shard, the tensor and the output."""
    def fail(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "copy_file_range", fail)
    src = _small(tmp_path)
    out = tmp_path / "out"
    err = _refused(tmp_path, ["convert", str(src), "-o", str(out), *W4A4], capsys, "Input/output error", out=out)
    assert "error: model.safetensors: tensor '" in err and "copy to model.safetensors failed" in err


def test_a_global_scale_with_no_float32_reciprocal_names_its_tensor(tmp_path, capsys):
    """compressed-tensors stores 1/S; with every E8M0 code 0, S is 2^-135 and 1/S is past float32."""
    src = _small(tmp_path, "compressed-tensors")
    _all_scales(src, 0)
    out = tmp_path / "out"
    _refused(tmp_path, ["convert", str(src), "-o", str(out), "--format", "compressed-tensors"], capsys,
             "weight_global_scale", ".weight_packed'", out=out)


def test_before_rename_runs_before_out_dir_appears_and_its_failure_leaves_none(tmp_path):
    """Through the library (no CLI session to roll back): what ``before_rename`` writes is in place before
    OUT_DIR, and when it fails no OUT_DIR appears."""
    from fp4pass.checkpoint import convert

    src, out = _small(tmp_path), tmp_path / "out"
    seen = []
    report = convert(src, out, input_scale=0.0123,
                     before_rename=lambda r: seen.append((out.exists(), r["summary"]["tensors_converted"])))
    assert seen == [(False, report["summary"]["tensors_converted"])] and out.is_dir()

    def full(report):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        convert(src, tmp_path / "out2", input_scale=0.0123, before_rename=full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
