"""setuptools hook (pyproject.toml `[tool.setuptools.cmdclass]`): generate the gRPC Python code while building.

Why at build time: a wheel (`pip install .`, a container image) then carries `services/proto_gen/` and its
runtime needs neither the proto/ folder nor grpcio-tools, a build dependency only (`[build-system] requires`).
An editable install (`pip install -e .`, `make install`) imports from the source tree, so there the code is
generated into the source tree instead (hash-stamped: nothing is redone when the protos did not change).

The generator is services/common/protos.py, loaded by file path: the build must not import the `services`
package (its `__init__` files are free to grow imports the build environment lacks).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

from setuptools.command.build_py import build_py

_ROOT = Path(__file__).resolve().parents[1]
_GENERATOR = _ROOT / "services" / "common" / "protos.py"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_specserve_proto_generator", _GENERATOR)
    assert spec is not None and spec.loader is not None, _GENERATOR
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):
    """build_py, then the generated package next to the copied sources."""

    def run(self) -> None:
        super().run()
        generator = _load_generator()
        if self.editable_mode:
            generator.ensure_generated(_ROOT / "proto", _ROOT / "services" / "proto_gen")
            return
        out = Path(self.build_lib) / "services" / "proto_gen"
        shutil.rmtree(out, ignore_errors=True)  # left by an earlier build in the same build folder
        out.mkdir(parents=True)
        generator.generate(_ROOT / "proto", out)
