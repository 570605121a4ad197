"""Generated gRPC code: built from proto/ when the package is built or installed, never committed, never at
import time.

The .proto files are the contract; committing generated code invites the two to drift. The build hook
(proto/build_hook.py, run by `pip install .`, `pip wheel .` and editable installs) calls `generate` so that a
wheel carries `services/proto_gen/` and a runtime image needs no grpcio-tools. In a source checkout,
`ensure_generated` (the Makefile's `proto` target) regenerates `services/proto_gen/` whenever the protos (or
the grpcio-tools version) change, detected by a content hash stamp rather than mtimes, so a branch switch is
picked up by `make install`.

protoc writes imports between generated modules as `from specserve.v1 import x_pb2`, which only resolves with
`services/proto_gen` on sys.path. Rather than mutate sys.path, the generated files are rewritten to import
`services.proto_gen.specserve.v1`: the generated code is then an ordinary subpackage of `services`.

Several processes (a test and the drafter it spawns) may race to generate: a file lock serialises them, and
files are written to a temporary folder and moved into place, so an importer never sees half a module.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import re
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

_REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = _REPO_ROOT / "proto"
GENERATED_ROOT = _REPO_ROOT / "services" / "proto_gen"
GENERATED_PACKAGE = "services.proto_gen"
_STAMP = ".stamp"
_LOCK = ".lock"
_IMPORT_FIX = re.compile(r"^(from|import) specserve\.", re.MULTILINE)


def _proto_files(proto_root: Path) -> list[Path]:
    return sorted(proto_root.rglob("*.proto"))


def _fingerprint(proto_root: Path) -> str:
    from importlib.metadata import version

    digest = hashlib.sha256(f"grpcio-tools {version('grpcio-tools')}\n".encode())
    for path in _proto_files(proto_root):
        digest.update(str(path.relative_to(proto_root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _run_protoc(proto_root: Path, out: Path) -> None:
    from grpc_tools import protoc  # build-time dependency only: imported when generating

    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto shipped with grpcio-tools
    files = [str(p.relative_to(proto_root)) for p in _proto_files(proto_root)]
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files} (command: {' '.join(args)})")


def _finish_package(out: Path) -> None:
    """Make every generated folder a package and point cross-module imports into services.proto_gen."""
    for folder in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    for module in [*out.rglob("*.py"), *out.rglob("*.pyi")]:
        text = module.read_text()
        fixed = _IMPORT_FIX.sub(rf"\1 {GENERATED_PACKAGE}.specserve.", text)
        if fixed != text:
            module.write_text(fixed)


def generate(proto_root: Path, out: Path) -> None:
    """Write the Python package of every .proto under `proto_root` into `out` (an existing folder): what the
    build hook puts into a wheel."""
    if not _proto_files(proto_root):
        raise FileNotFoundError(f"no .proto files under {proto_root}")
    _run_protoc(proto_root, out)
    _finish_package(out)


def ensure_generated(proto_root: Path = PROTO_ROOT, out: Path = GENERATED_ROOT) -> None:
    """Regenerate `out` from `proto_root` unless it is already up to date. Safe to call often and from
    several processes at once; cheap when nothing changed (one hash of the .proto files)."""
    stamp = out / _STAMP
    fingerprint = _fingerprint(proto_root)
    if stamp.is_file() and stamp.read_text() == fingerprint:
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / _LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == fingerprint:
            return  # another process generated while this one waited
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".proto_gen-") as tmp:
            staging = Path(tmp)
            generate(proto_root, staging)
            for child in out.iterdir():
                if child.name not in (_LOCK, _STAMP):
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            for child in staging.iterdir():
                child.rename(out / child.name)
        stamp.write_text(fingerprint)
    importlib.invalidate_caches()


def load(name: str) -> tuple[ModuleType, ModuleType]:
    """(messages, grpc stubs) of `proto/specserve/v1/<name>.proto`, as the build generated them:
    `drafter_pb2, drafter_pb2_grpc = load("drafter")`."""
    base = f"{GENERATED_PACKAGE}.specserve.v1.{name}"
    try:
        return importlib.import_module(f"{base}_pb2"), importlib.import_module(f"{base}_pb2_grpc")
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith(GENERATED_PACKAGE):
            raise
        raise RuntimeError(
            f"the generated gRPC code ({base}_pb2) is missing: install the package (`pip install .`), or in a "
            "source checkout run `make proto` (editable installs generate it when they install)"
        ) from error
