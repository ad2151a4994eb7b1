"""What the README tells a newcomer about installing (issue #10, items 13-14):
every install command is one that works from a checkout (muser-kv is not on
PyPI) with extras pyproject.toml defines; the test extra brings no CUDA wheels;
CI (.ci/run) runs the README's test command with the nvrtc extra and requires
the NVRTC tests."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else None


@pytest.fixture(scope="module")
def extras():
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def pip_installs(text: str):
    """Every ``pip install ...`` in ``text``: its target, as written."""
    return re.findall(r"pip install (?:-q )?((?:-e )?[^\s`|]+)", text)


def test_every_readme_install_is_from_the_checkout_with_real_extras(extras):
    # the registry name appears once, to say it is not there
    assert "`pip install muser-kv` finds nothing" in README
    targets = pip_installs(README.replace("`pip install muser-kv` finds nothing", ""))
    assert targets, "the README shows how to install"
    for target in targets:
        assert target.startswith("-e "), f"not from a checkout: pip install {target}"
        spec = target[3:].strip("\"'")
        m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", spec)
        assert m, f"pip install {target}: expected . or .[extras]"
        for extra in filter(None, (m.group(1) or "").split(",")):
            assert extra in extras, f"pip install {target}: no extra {extra!r}"
    assert not re.search(r'pip install "?muser-kv\[', README)


def test_the_test_extra_brings_no_cuda_wheels(extras):
    assert not [d for d in extras["test"] if d.startswith("nvidia")]
    nvrtc = [d.split(";")[0].split("=")[0].split(">")[0] for d in extras["nvrtc"]]
    assert nvrtc == ["nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cuda-cccl"]


def test_ci_runs_the_readme_test_command_with_the_nvrtc_extra():
    readme_cmd = re.search(r"# 2\. install and run the tests\n(.+)\n", README).group(1)
    assert '".[cpu,test]"' in readme_cmd and readme_cmd.endswith(
        ".venv/bin/python -m pytest -q -n 2 --dist loadfile")  # two workers: CI's two cores
    ci_cmd = next(line for line in CI.splitlines() if "pip install" in line)
    assert ci_cmd == readme_cmd.replace('".[cpu,test]"', '".[cpu,test,nvrtc]"')
    assert "export MUSER_KV_REQUIRE_NVRTC=1" in CI


def test_the_plot_hint_says_how_to_install_from_the_checkout():
    import muser_kv.serving.cli

    help_text = muser_kv.serving.cli.build_parser()._subparsers._group_actions[0].choices[
        "footprint"].format_help()
    assert "muser-kv[" not in help_text
    source = Path(muser_kv.serving.cli.__file__).read_text()
    assert "pip install 'muser-kv[plot]'" not in source
    assert "pip install -e '.[plot]'" in source
