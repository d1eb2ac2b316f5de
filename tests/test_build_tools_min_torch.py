"""build_tools' torch-2.11 jobs (make check-torch-headers, make test-min-torch) on what review DH ran into: a wheel
with a local version label (+cpu, from an index serving those) was not recognized (IndexError, and a download at every
run), and a failed import of the copy built against 2.11 showed only "returned non-zero exit status 1"."""

import subprocess
import sys

import pytest

from build_tools import check_torch_headers, test_min_torch

TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"


@pytest.mark.parametrize("label", ["", "+cpu"])
def test_a_kept_wheel_is_found_without_a_download(label, tmp_path, monkeypatch):
    wheel = tmp_path / f"torch-2.11.0{label}-{TAG}-{TAG}-linux_x86_64.whl"
    wheel.touch()
    (tmp_path / f"torch-2.11.1-{TAG}-{TAG}-linux_x86_64.whl").touch()  # another release is not taken
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"downloaded again: {a}"))
    assert check_torch_headers.fetch_wheel("2.11.0", str(tmp_path)) == str(wheel)


def test_a_download_that_brings_no_wheel_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    with pytest.raises(SystemExit, match="pip downloaded no torch 2.11.0 wheel"):
        check_torch_headers.fetch_wheel("2.11.0", str(tmp_path))


def test_a_failed_import_of_the_copy_shows_why(tmp_path):
    (tmp_path / "decent_comm").mkdir()
    init = tmp_path / "decent_comm" / "__init__.py"
    init.write_text("raise ImportError('undefined symbol _ZN3c10 (another torch)')")
    with pytest.raises(SystemExit, match="undefined symbol _ZN3c10"):
        test_min_torch.check_imports(sys.executable, str(tmp_path), "2.11.0")
