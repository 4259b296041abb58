"""The wheel users install (``scripts/wheel.sh``): built, repaired by auditwheel, installed
into a fresh virtual environment, every shared library it needs resolved inside the wheel or
to glibc's own libraries (not the system's libhwloc), and a BF16 and an AMXINT8 forward run
there. Its third-party Python dependencies are taken from this environment through a ``.pth``
entry placed after the fresh environment's own packages (a second 2 GB torch download proves
nothing about our wheel). Set ``KT_SKIP_WHEEL_TEST=1`` to skip."""

from __future__ import annotations

import glob
import os
import re
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    os.environ.get("KT_SKIP_WHEEL_TEST") == "1", reason="KT_SKIP_WHEEL_TEST=1"
)
# glibc's own libraries and the loader: what a manylinux wheel may take from the system.
GLIBC = re.compile(r"^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libgcc_s)[.-]")

RUN = """
import kt_kernel, torch
print(kt_kernel.__file__)
for method in ("BF16", "AMXINT8"):
    w = kt_kernel.KTMoEWrapper(0, 8, 2, 128, 128, None, 2, 1, "", 16, method=method)
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)
    w.load_weights_from_tensors(mk(8, 128, 128), mk(8, 128, 128), mk(8, 128, 128), torch.arange(8))
    x = torch.randn(3, 128).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    out = w.forward(x, ids, torch.rand(3, 2))
    assert out.shape == (3, 128) and out.abs().sum() > 0
    print(method, "ok")
"""


@pytest.fixture(scope="module")
def wheel() -> Path:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "wheel.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (path,) = glob.glob(str(ROOT / "dist" / "kt_kernel-*.whl"))
    print(r.stdout[-2000:])
    return Path(path)


def test_the_wheel_is_abi3_manylinux_and_small(wheel):
    name = wheel.name
    assert "-cp310-abi3-" in name and "manylinux" in name, name
    assert wheel.stat().st_size < 20 << 20, wheel.stat().st_size


def test_a_fresh_environment_runs_it_without_the_system_hwloc(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", wheel], check=True)
    fresh_site = subprocess.run(
        [py, "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # Dependencies from this environment, after the fresh one's own packages.
    Path(fresh_site, "zz_deps.pth").write_text(site.getsitepackages()[0] + "\n")
    (ext,) = glob.glob(os.path.join(fresh_site, "kt_kernel", "_kt_core*.so"))
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    ldd = subprocess.run(["ldd", ext], capture_output=True, text=True, check=True, env=env)
    for line in ldd.stdout.splitlines():
        lib = line.split()[0]
        target = line.split("=>")[-1].split("(")[0].strip()
        if GLIBC.match(os.path.basename(lib)):
            continue
        assert "not found" not in line, line
        assert target.startswith(fresh_site), f"{lib} resolves outside the wheel: {line}"
    assert "hwloc" in ldd.stdout, "expected the bundled libhwloc in the dependency list"
    r = subprocess.run([py, "-c", RUN], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.split()
    assert lines[0].startswith(fresh_site), lines[0]
    assert "BF16" in r.stdout and "AMXINT8" in r.stdout
    assert sys.executable != str(py)
