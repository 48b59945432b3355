"""Optional dependencies: a missing extra is one usage line with the install command; a broken one raises."""

import sys

import pytest

from fp4pass.errors import UsageError
from fp4pass.extras import require


@pytest.mark.parametrize("module, extra, dist", [("matplotlib", "plot", "matplotlib"),
                                                 ("onnx_graphsurgeon", "graphsurgeon", "onnx-graphsurgeon")])
def test_missing_extra_names_the_install_command(monkeypatch, module, extra, dist):
    monkeypatch.setitem(sys.modules, module, None)  # import of it fails as when it is not installed
    with pytest.raises(UsageError) as info:
        require(module, extra, "the feature")
    assert str(info.value) == f"the feature needs {dist}, which is not installed: pip install 'fp4pass[{extra}]'"


def test_broken_installation_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "fp4pass_fake_extra.py").write_text("import fp4pass_missing_dependency_of_the_extra\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="fp4pass_missing_dependency_of_the_extra"):
        require("fp4pass_fake_extra", "plot", "the feature")


def test_diff_plot_without_matplotlib_fails_before_any_work(monkeypatch, capsys, tmp_path):
    import fp4pass.onnx.numerics as numerics
    from fp4pass.cli import main
    from fp4pass.examples.moe import build_tiny_mlp
    import onnx

    onnx.save(build_tiny_mlp(), tmp_path / "m.onnx")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(numerics, "diff", lambda *a, **k: pytest.fail("work started"))
    code = main(["diff", str(tmp_path / "m.onnx"), str(tmp_path / "m.onnx"), "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'fp4pass[plot]'" in err and not (tmp_path / "p.png").exists()
