"""The package as a user installs it: ``python -m build`` makes the sdist and, from it, the
wheel; the wheel goes into a fresh virtual environment that already has torch and Horovod
(those of the project's venv, reached through a ``.pth`` path entry, which does not bring
the checkout's editable install along); two Gloo ranks then train with MiCRO and PowerSGD
from a directory outside the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

from hvm_testbed.launch import horovodrun_cmd, run_bounded

REPO = Path(__file__).resolve().parent.parent


def _copy_sources(dest: Path) -> None:
    """The files a clean clone holds (tracked, and new ones not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def test_wheel_installs_and_trains_outside_the_checkout(tmp_path):
    src, dist = tmp_path / "src", tmp_path / "dist"
    _copy_sources(src)
    run_bounded([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
                600, cwd=tmp_path)
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(dist.iterdir())
    with zipfile.ZipFile(wheels[0]) as whl:
        names = whl.namelist()
        metadata = next(whl.read(n).decode() for n in names if n.endswith("/METADATA"))
        # No network-namespace, traffic-control or SSH code in the installed library.
        emulation = [n for n in names if n.endswith(".py") and any(
            word in whl.read(n).decode() for word in ("ip netns", "sshd", "tc qdisc", "tbf"))]
    assert not emulation, emulation
    # The library depends on torch and Horovod only; the rest are extras.
    required = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert sorted(r.split("=")[0].split(">")[0].strip() for r in required) == ["horovod", "torch"]
    assert any(n.startswith("horovod_micro/_select") and n.endswith(".so") for n in names)
    assert not any(n.startswith("train/") for n in names)  # the example scripts stay out
    # The test bed (launcher, emulated hosts) stays in the checkout; loopback ranks ship.
    assert not any(n.startswith("hvm_testbed/") or n.endswith(("cluster.py", "launch.py"))
                   for n in names), [n for n in names if "testing" in n or "testbed" in n]
    assert "horovod_micro/testing/loopback.py" in names

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                  "print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    (target / "project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run_bounded([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheels[0])], 300)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(REPO / "tests" / "scripts" / "wheel_smoke.py", outside)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = run_bounded(horovodrun_cmd(2, "gloo", [str(python), "wheel_smoke.py"]), 300,
                      cwd=outside, base_env=clean).stdout
    line = next(x for x in out.splitlines() if "SMOKE " in x)
    result = json.loads(line.split("SMOKE ", 1)[1])
    assert result["file"].startswith(str(target)), result  # the wheel, not the checkout
    assert result["native"].startswith(str(target)), result
    for name in ("micro", "powersgd"):
        assert result[name]["same_weights"] and result[name]["method"] == name, result
        assert result[name]["bytes"] > 0, result
