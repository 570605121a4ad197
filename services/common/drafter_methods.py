"""The registry of drafter methods: a method's name -> the module that builds its proposer, and its options.

Why module paths and not classes: the verifier, the gateway and the launcher read the list of methods (to check
a speculative config, to plan `specserve serve`) without importing any drafter code; only a process that runs a
proposer (the drafter service, and the in-process engine of `specserve generate` and the bench) imports the
method's module. A new method is one module under services/drafter/methods/ plus one line in BUILTIN_METHODS
(with its options class from method_options.py, if it has options); a package outside this repository adds one
with an entry point in the group "specserve.drafter_methods" (`name = "package.module"`), the usual Python
plug-in mechanism, and declares its options as OPTIONS (a MethodOptions subclass) in that module.

A method module provides `build_proposer(config: SpeculativeConfig) -> Proposer`, which raises
MethodUnavailableError with a clear message when the method cannot run here (a native package missing or not
built for this platform), so `--method suffix` fails at start-up and every other method still works.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING

from services.common.method_options import EagleOptions, MethodOptions, NgramOptions, SuffixOptions

if TYPE_CHECKING:
    from services.common.proposer import Proposer
    from services.common.speculative_config import SpeculativeConfig

ENTRY_POINT_GROUP = "specserve.drafter_methods"
NO_SPECULATION = "none"  # not a method: turns speculation off (server default or per request)
# Not a drafter either: the verifier serves without speculation and writes every request's target hidden states
# to files (vLLM's name; services/verifier/hidden_state_files.py)
EXTRACT_HIDDEN_STATES = "extract_hidden_states"
# Not a drafter service's method: every verifier drafts a request's predicted output (OpenAI's `prediction`) itself,
# under this name (services/verifier/prediction_proposer.py)
PREDICTION = "prediction"



@dataclass(frozen=True)
class BuiltinMethod:
    module: str  # imported only by a process that runs the proposer
    options: type[MethodOptions] = MethodOptions  # its fields of a speculative config (method_options.py)


BUILTIN_METHODS = MappingProxyType({
    "draft_model": BuiltinMethod("services.drafter.methods.draft_model"),
    "eagle": BuiltinMethod("services.drafter.methods.eagle", EagleOptions),
    # vLLM's name for EAGLE-3 heads; the module reads either kind of head, whichever the folder holds
    "eagle3": BuiltinMethod("services.drafter.methods.eagle", EagleOptions),
    "ngram": BuiltinMethod("services.drafter.methods.ngram", NgramOptions),
    "suffix": BuiltinMethod("services.drafter.methods.suffix", SuffixOptions),
})


# What `specserve serve` drafts with when no --speculative-config is given: the first method here that can run
# on this machine. `make bench` ranks them: suffix drafts at least as well as ngram on every workload (HumanEval,
# the code edit, the edit sequence; README "Benchmark"), and ngram needs nothing native.
SERVE_PREFERENCE = ("suffix", "ngram")


class MethodUnavailableError(RuntimeError):
    """The method exists but cannot run in this process (e.g. its native package is not installed)."""


class UnknownMethodError(ValueError):
    """No registered method has this name."""


@functools.cache
def _plugin_methods() -> MappingProxyType:
    """Methods that installed packages declare as entry points (read once per process)."""
    return MappingProxyType({ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)})


def method_modules() -> dict[str, str]:
    """Every registered method -> its module; a built-in name cannot be taken over by a plug-in."""
    return {**_plugin_methods(), **{name: method.module for name, method in BUILTIN_METHODS.items()}}


def method_names() -> tuple[str, ...]:
    return tuple(sorted(method_modules()))


def check_method(name: str) -> str:
    """`name` if it is a registered method or "none"; otherwise UnknownMethodError naming the choices."""
    if name in (NO_SPECULATION, EXTRACT_HIDDEN_STATES) or name in method_modules():
        return name
    raise UnknownMethodError(
        f"unknown speculative method {name!r}; available: {', '.join(method_names())}, or {NO_SPECULATION!r}"
    )


def load_method(name: str) -> ModuleType:
    """Import the module of method `name` and check that it provides build_proposer."""
    module_path = method_modules().get(name)
    if module_path is None:
        check_method(name)  # raises UnknownMethodError (also for "none", which builds nothing)
        raise UnknownMethodError(f"{name!r} turns speculation off; it has no proposer to build")
    module = importlib.import_module(module_path)
    if not callable(getattr(module, "build_proposer", None)):
        raise TypeError(f"drafter method module {module_path} has no build_proposer(config) function")
    return module


def method_options(name: str) -> type[MethodOptions]:
    """The options class of method `name` (MethodOptions, i.e. none, for "none" and extract_hidden_states). A
    built-in's is in the registry, so checking a config imports no drafter code; a plug-in's is its module's
    OPTIONS, so checking a config for a plug-in method imports that module."""
    if name in BUILTIN_METHODS:
        return BUILTIN_METHODS[name].options
    if name in (NO_SPECULATION, EXTRACT_HIDDEN_STATES):
        return MethodOptions
    options = getattr(load_method(name), "OPTIONS", MethodOptions)
    if not (isinstance(options, type) and issubclass(options, MethodOptions)):
        raise TypeError(f"drafter method {name!r}: OPTIONS must be a subclass of "
                        "services.common.method_options.MethodOptions")
    return options


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer `config.method` names, configured by `config`."""
    return load_method(config.method).build_proposer(config)


def why_not_runnable(config: SpeculativeConfig) -> str | None:
    """None if `config.method`'s proposer can be built here, else its MethodUnavailableError message. Building
    a proposer is cheap for ngram and suffix; draft_model loads its model."""
    try:
        build_proposer(config)
    except MethodUnavailableError as error:
        return str(error)
    return None


def first_runnable(names: tuple[str, ...], config: SpeculativeConfig) -> tuple[str, list[str]]:
    """The first of `names` that can run here with `config`'s options, and why each one before it could not."""
    skipped = []
    for name in names:
        reason = why_not_runnable(config.model_copy(update={"method": name}))
        if reason is None:
            return name, skipped
        skipped.append(f"{name}: {reason}")
    raise MethodUnavailableError("none of the methods can run here: " + "; ".join(skipped))
