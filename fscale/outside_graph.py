"""`outside_graph`: run a function outside torch.compile's graphs, importing Dynamo only when used.

``torch.compiler.disable`` imports ``torch._dynamo`` when it decorates, and fscale decorates
functions in modules that every step imports (the collectives' bookkeeping, the generators'
seeding, the optimizers' fused calls): that import is about half of ``import fscale``'s time
(2 s of 4.5 s on a two-core host), paid by every rank process; and the disabled wrapper's
switch of the frame evaluator made each eager call cost 1.2 µs where the call below costs 0.4 µs
(1.6 µs once Dynamo is imported).

Nothing can be tracing before ``torch._dynamo`` is imported. So until it is, a decorated function
is called as it is; when the import completes (a finder on ``sys.meta_path`` sees it), each one
is switched to its ``torch.compiler.disable`` form before any frame can be traced. The call goes
through ``torch._disable_dynamo``, torch's own lazy form, whose wrapper lives in a module that
Dynamo skips, and it carries the marks Dynamo reads on a disabled function: a traced caller
breaks its graph at the call and runs it eagerly, reported and guarded as at a function decorated
with ``torch.compiler.disable`` (tests/test_compile.py pins the graph-break sites). Its
wrapper looks up the form to call in the function's ``__dynamo_disable`` attribute (torch 2.6
to 2.14 alike), which is what this module sets. A function decorated once Dynamo is imported
gets the ``torch.compiler.disable`` form itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

import torch

__all__ = ["outside_graph"]

F = TypeVar("F", bound=Callable[..., Any])

_DYNAMO = "torch._dynamo"
_FORM = "__dynamo_disable"  # where torch._disable_dynamo's wrapper finds what to call
_MARKS = {
    "_torchdynamo_disable": True,
    "_torchdynamo_disable_recursive": True,
    "_torchdynamo_disable_msg": None,
}
_waiting: list[Callable[..., Any]] = []
_lock = threading.Lock()


def outside_graph(fn: F) -> F:
    """`fn` run eagerly and whole under torch.compile (``torch.compiler.disable(fn,
    recursive=True)``), with Dynamo imported only once something imports it."""
    with _lock:
        if _DYNAMO in sys.modules:  # nothing to wait for: no lazy layer around the disabled form
            return torch.compiler.disable(fn, recursive=True)  # type: ignore[return-value]
        setattr(fn, _FORM, fn)
        _waiting.append(fn)
        _watch_for_dynamo()
    wrapper = torch._disable_dynamo(fn, recursive=True)
    # The marks torch.compiler.disable puts on its wrapper, which Dynamo reads on a callee: the
    # break is then reported ("Skip calling `torch.compiler.disable()`d function", naming `fn`)
    # and guarded as at any disabled function, not as a call into torch's own files.
    for mark, value in _MARKS.items():
        setattr(wrapper, mark, value)
    return wrapper  # type: ignore[return-value]


def _disable_waiting() -> None:
    with _lock:
        for fn in _waiting:
            setattr(fn, _FORM, torch.compiler.disable(fn, recursive=True))
        _waiting.clear()


class _DynamoImport(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` as the other finders do and disables the waiting functions as
    soon as its module has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _disable_waiting()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _watch_for_dynamo() -> None:
    if not any(isinstance(finder, _DynamoImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DynamoImport())
